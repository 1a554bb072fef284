"""A Sequence decodes its text when the text is read (chapter 13), not at every appended token: the
text read after every token, read once at the end, and HF's decode of the same ids all agree, for
every way a sequence ends; only a request with stop strings pays the detokenizer inside the step."""

from __future__ import annotations

import functools
import random

import pytest

from minillm import SamplingParams
from minillm.sequence import Sequence
from minillm.tokenizer import IncrementalDetokenizer


@functools.cache
def _partial(tok) -> list[int]:
    """Ids whose bytes are not UTF-8 on their own: pieces of a character split across tokens."""
    out = []
    for i in range(tok.vocab_size):
        try:
            tok.decode_bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    assert len(out) > 50  # a byte-level BPE has many
    return out


def _ids(rng: random.Random, tok, n: int) -> list[int]:
    """Random ids, a fifth of them character pieces, so that unfinished characters occur (mid-text
    and at the end, where the final flush turns them into U+FFFD)."""
    partial, special = _partial(tok), set(tok.added_tokens.values())  # specials: decode shows them, the text skips them
    ids = []
    while len(ids) < n:
        t = rng.choice(partial) if rng.random() < 0.2 else rng.randrange(tok.vocab_size)
        if t not in special:
            ids.append(t)
    return ids


def _run(tok, ids, params, read_every_step: bool, eos=(0,)) -> Sequence:
    seq = Sequence(0, [1, 2, 3], params, 0, tok, list(eos), max_len=10_000)
    for t in ids:
        if seq.finished:
            break
        seq.append(t)
        if read_every_step:
            seq.text  # noqa: B018 (the read is the point)
    return seq


@pytest.mark.parametrize("end", ["length", "eos", "stop_token"])
def test_text_read_late_equals_text_read_every_step_and_decode(tok, seed, end):
    rng = random.Random(seed)
    ids = _ids(rng, tok, rng.randint(5, 60)) + [rng.choice(_partial(tok))]  # ends mid-character
    eos = ids[len(ids) // 2] if end == "eos" else tok.vocab_size - 1
    stop_ids = [ids[len(ids) // 3]] if end == "stop_token" else []
    params = SamplingParams(max_tokens=len(ids), ignore_eos=end != "eos", stop_token_ids=stop_ids)
    late = _run(tok, ids, params, read_every_step=False, eos=[eos])
    early = _run(tok, ids, params, read_every_step=True, eos=[eos])
    assert late.finished and late.finish_reason == ("length" if end == "length" else "stop")
    assert late.output_ids == early.output_ids
    assert late.text == early.text == tok.decode(late.output_ids)
    assert late.text == late.text  # a second read adds nothing (the flush happens once)


def test_without_stop_strings_the_step_never_detokenizes(tok, seed, monkeypatch):
    rng = random.Random(seed)
    ids = _ids(rng, tok, 20)
    seq = Sequence(0, [1], SamplingParams(max_tokens=100), 0, tok, [], max_len=10_000)
    calls = []
    monkeypatch.setattr(seq.detok, "step", lambda t, f=seq.detok.step: calls.append(t) or f(t))
    for t in ids:
        seq.append(t)
    assert calls == []
    eager = IncrementalDetokenizer(tok, skip_special_tokens=True)  # what the step used to do, token by token
    want = "".join(eager.step(t) for t in ids)  # unfinished: a character still incomplete is held back
    assert seq.text == want and calls == ids  # caught up in order, once


def test_stop_strings_still_cut_the_text_at_the_token_that_completes_them(tok, seed):
    rng = random.Random(seed)
    ids = [i for i in _ids(rng, tok, 80) if tok.decode([i]).strip()]
    text = tok.decode(ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(max_tokens=len(ids), stop=[stop], ignore_eos=True)
    seq = _run(tok, ids, params, read_every_step=False)
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert stop not in seq.text and text.startswith(seq.text)
