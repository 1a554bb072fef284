"""Encoding with a token budget and a stop hook (minillm/tokenizer/budget.py; probe round 4, M4).

A text past the budget is refused after work for about the budget's tokens, not for the whole text;
under the budget (or at it exactly) the ids are the same as without one, and HF's; a stop hook ends
the BPE of one long chunk within a few thousand merges."""

from __future__ import annotations

import random
import time

import pytest

from minillm.tokenizer import EncodeStopped, TooManyTokens
from minillm.tokenizer.samples import FIXED, random_texts


def test_a_long_run_past_the_budget_is_refused_after_the_budgets_work(tok, monkeypatch):
    # one 650,000-byte chunk (GPT-2's pattern does not cut a run of letters): its whole BPE took 2.8 s
    # on an idle 2-core machine before the budget (9 s loaded); the bound stops after ~33,000 bytes
    from minillm.tokenizer import tokenizer as module

    tok.encode("a" * 400, max_tokens=200)  # not timed: builds the vocabulary's prefixes (once, ~0.5 s)
    real, lengths = module.bpe, []
    monkeypatch.setattr(module, "bpe", lambda ids, *args: lengths.append(len(ids)) or real(ids, *args))
    for text in ["a" * 650_000, "é" * 300_000, "xyz" * 200_000]:
        start = time.perf_counter()
        with pytest.raises(TooManyTokens, match="max_tokens=8192"):
            tok.encode(text, max_tokens=8192)
        assert time.perf_counter() - start < 1.5, text[:3]  # 0.02-0.12 s idle
    assert lengths == []  # refused by the bound, before any BPE


def test_many_short_chunks_stop_at_the_budget(tok):
    text = "ab " * 200_000  # 200,000 chunks: cut and encoded only until the budget is passed
    start = time.perf_counter()
    with pytest.raises(TooManyTokens):
        tok.encode(text, max_tokens=1000)
    assert time.perf_counter() - start < 0.5


def test_ids_under_the_budget_equal_hf_and_the_unbudgeted_ones(tok, hf_tok, seed):
    rng = random.Random(seed)
    texts = FIXED + random_texts(seed, 150) + ["\n\n".join(rng.choice(FIXED) for _ in range(200))]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.encode(text, max_tokens=len(ids)) == ids  # exactly at the budget: still fine
        if ids:
            with pytest.raises(TooManyTokens):
                tok.encode(text, max_tokens=len(ids) - 1)


def test_the_lower_bound_never_refuses_a_text_that_fits(tok, seed):
    # long chunks (so the fewest-tokens bound runs: more bytes than the budget), budget = their count
    rng = random.Random(seed)
    for _ in range(40):
        alphabet = rng.choice(["ab", "aeiou", "ACGT", "#-=", " ", "abcdefghijklmnopqrstuvwxyz", "éü東"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(300, 3000)))
        ids = tok.encode(text)
        assert len(text.encode()) > len(ids)
        assert tok.encode(text, max_tokens=len(ids)) == ids, text[:40]
        with pytest.raises(TooManyTokens):
            tok.encode(text, max_tokens=len(ids) - 1)


def test_the_bound_on_the_fewest_tokens_is_a_lower_bound(tok, seed):
    from minillm.tokenizer.budget import needs_more_than, spellings

    prefixes, longest = spellings(tok.vocab)
    rng = random.Random(seed)
    for _ in range(60):
        text = "".join(rng.choice("aab c-#é") for _ in range(rng.randint(200, 1500)))
        data = text.encode()
        count = len(tok.encode(text))
        for limit in (count, count + 1, count * 2):  # it fits: never "needs more"
            assert not needs_more_than(data, limit, prefixes, longest), (text[:30], limit)
    # and it does refuse: 4,000 'a's are 1,000 ids, and no token of SmolLM2's spells 40 of them
    assert len(tok.encode("a" * 4000)) == 1000 and needs_more_than(b"a" * 4000, 100, prefixes, longest)


def test_should_stop_ends_one_long_chunk_early(tok):
    calls = []

    def should_stop():
        calls.append(time.perf_counter())
        return len(calls) >= 3

    start = time.perf_counter()
    with pytest.raises(EncodeStopped):
        tok.encode(" " * 300_000 + "x", should_stop=should_stop)  # fits (4,690 ids) but took 6.6 s
    assert time.perf_counter() - start < 1.5 and len(calls) == 3


def test_max_tokens_must_be_a_count(tok):
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_tokens"):
            tok.encode("hi", max_tokens=bad)


def test_chat_template_ids_stop_at_the_budget(tok):
    messages = [{"role": "user", "content": "hello world " * 50}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert tok.apply_chat_template(messages, tokenize=True, max_tokens=len(ids)) == ids
    with pytest.raises(TooManyTokens):
        tok.apply_chat_template(messages, tokenize=True, max_tokens=len(ids) - 1)


# ---- the chat template's render budget (probe round 4, m6): a template is code from the model's files


def _templated(tok, template: str):
    import copy

    t = copy.copy(tok)
    t.chat_template = template
    return t


def test_nested_loops_in_a_template_stop_at_the_step_budget(tok):
    # two nested range(5000) loops: 25M empty steps ran for seconds (99999 x 99999 hung LLM.chat)
    start = time.perf_counter()
    t = _templated(tok, "{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}hi")
    with pytest.raises(ValueError, match="loop steps"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    messages = [{"role": "user", "content": "x"}] * 3000  # the messages inside the messages: 9M steps
    t = _templated(tok, "{% for a in messages %}{% for b in messages[1:] %}{% endfor %}{% endfor %}hi")
    with pytest.raises(ValueError, match="loop steps"):
        t.apply_chat_template(messages)
    assert time.perf_counter() - start < 2.0


def test_a_template_that_writes_too_much_is_refused(tok, monkeypatch):
    from minillm.tokenizer import chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDERED_CHARS", 1 << 20)
    t = _templated(tok, "{% for i in range(2000) %}{{ messages[0]['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="more than 1,048,576 characters"):
        t.apply_chat_template([{"role": "user", "content": "y" * 1000}])
    t = _templated(tok, "{{ 'x' * 10000000 }}")  # refused before the string is built
    with pytest.raises(ValueError, match="10000000 items"):
        t.apply_chat_template([{"role": "user", "content": "z"}])
    with pytest.raises(ValueError, match=r"7 \*\* 100000000"):
        _templated(tok, "{{ 7 ** 100000000 }}").apply_chat_template([{"role": "user", "content": "z"}])
