"""The engine core sends token ids; the API process makes the text (issue 24, vLLM V1's split).

The oracle is LLM.generate, which detokenizes in the engine as before. On fresh random prompts of
the tiny byte-level tokenizer (a random model emits lone UTF-8 lead and continuation bytes, so its
characters span tokens and some completions end inside one), n > 1, logprobs, both values of
skip_special_tokens and a stop string:

- the core's rows carry text only for the sequence with a stop string, and the core runs the
  detokenizer for no other sequence (the old core decoded every sequence, every step);
- what a client reads, streamed deltas joined, is LLM.generate's text, ids, logprobs and finish and
  stop reasons, with the core in a thread and in a process of its own, and the API side keeps no
  detokenizer once its requests have ended (finished or aborted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import random
import re
import time

import pytest
from serve_utils import CONTEXT
from test_async_engine import drain, run

from minillm import LLM, SamplingParams
from minillm.tokenizer.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def oracle(tiny_chat_model):
    return LLM(str(tiny_chat_model), device="cpu")


# a well-formed multi-byte UTF-8 character (the lead byte's range, then its continuation bytes)
_MULTIBYTE = re.compile(rb"[\xC2-\xDF][\x80-\xBF]|[\xE0-\xEF][\x80-\xBF]{2}|[\xF0-\xF4][\x80-\xBF]{3}")


def _requests(tok, seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Random prompts and sampling; the last request has a stop string its greedy output contains."""
    rng = random.Random(seed)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(len(tok.vocab) - 1) for _ in range(rng.randint(2, 9))]
        params = SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), n=rng.choice([1, 1, 2, 3]),
                                max_tokens=rng.randint(6, 24), ignore_eos=rng.random() < 0.7,
                                skip_special_tokens=rng.random() < 0.5, logprobs=rng.choice([None, None, 2]))
        requests.append((f"r{i}", prompt, params))
    return requests


def _with_stop(oracle, requests) -> list:
    """requests + one greedy request whose stop string is two ASCII characters in the middle of its text."""
    prompt = oracle.tokenizer.encode("the cat sat")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = oracle.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].text
    stop = next(plain[i : i + 2] for i in range(3, len(plain) - 2) if re.fullmatch(r"[!-~]{2}", plain[i : i + 2])
                and plain[i : i + 2] not in plain[: i + 1])
    return requests + [("stop", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))]


def _spans_tokens(tok, ids: list[int]) -> bool:
    """Some well-formed multi-byte character of the output has its bytes in more than one token."""
    ends, n = set(), 0
    for t in ids:
        n += len(tok.vocab[t])
        ends.add(n)
    data = b"".join(tok.vocab[t] for t in ids)
    return any(any(m.start() < e < m.end() for e in ends) for m in _MULTIBYTE.finditer(data))


def _ends_inside_a_character(tok, ids: list[int], skip: bool) -> bool:
    detok = IncrementalDetokenizer(tok, skip)
    for t in ids:
        detok.step(t)
    return detok.flush() != ""


@pytest.mark.slow
def test_core_rows_carry_ids_and_text_only_for_stop_strings(tiny_chat_model, oracle, seed, monkeypatch):
    """EngineCore on an LLMEngine: rows of sequences without stop strings have text None and the
    detokenizer never steps for them; the stop-string request still stops exactly, its text in its rows."""
    from minillm.engine import deltas, engine_core

    requests = _with_stop(oracle, _requests(oracle.tokenizer, seed))
    engine = LLM(str(tiny_chat_model), device="cpu").engine
    commands = queue.Queue()
    for rid, ids, params in requests:
        commands.put(("add", rid, ids, params, 0.0))
    commands.put(("stop", False))
    stepped, rows = [0], []
    step = IncrementalDetokenizer.step

    def counted(self, token_id):
        stepped[0] += 1
        return step(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", counted)
    assert engine_core.EngineCore(engine, commands, lambda r, load: rows.extend(r)).run() is None
    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    texts = [o[1] for row in rows if row[0] != "stop" for o in row[4]]
    assert texts and all(t is None for t in texts), "the core detokenized a request without stop strings"
    stop_ids = [t for row in rows if row[0] == "stop" for o in row[4] for t in o[2]]
    assert stepped[0] == len(stop_ids)  # one step per token of the stop-string request, none for the rest

    want = oracle.generate([{"prompt_token_ids": ids} for _, ids, _ in requests], [p for *_, p in requests],
                           use_tqdm=False)
    detoks = {rid: deltas.RequestDetokenizer(oracle.tokenizer, p.skip_special_tokens) for rid, _, p in requests}
    got = {o.request_id: o for o in deltas.outputs_of([detoks[r[0]].fill(r) for r in rows], lambda rid: None)}
    for (rid, _, _), w in zip(requests, want):
        for c, g in zip(w.outputs, got[rid].outputs):
            assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == \
                   (c.text, c.token_ids, c.finish_reason, c.stop_reason), (rid, c.index)
    assert got["stop"].outputs[0].finish_reason == "stop" and requests[-1][2].stop[0] not in got["stop"].outputs[0].text
    assert not any(d.detoks for d in detoks.values())  # every completion ended: its detokenizer was let go


@pytest.mark.parametrize("core", ["thread", "process"])
@pytest.mark.slow
def test_client_text_is_generate_text(tiny_chat_model, oracle, seed, core):
    tok = oracle.tokenizer
    requests = _with_stop(oracle, _requests(tok, seed))
    want = oracle.generate([{"prompt_token_ids": ids} for _, ids, _ in requests], [p for *_, p in requests],
                           use_tqdm=False)
    # the cases this is about happen in these outputs: characters split across tokens, an unfinished one at the end
    completions = [(c, p) for w, (*_, p) in zip(want, requests) for c in w.outputs]
    assert any(_spans_tokens(tok, c.token_ids) for c, _ in completions)
    assert any(_ends_inside_a_character(tok, c.token_ids, p.skip_special_tokens) for c, p in completions)

    async def body(engine):
        deltas, text, ids, finished = await drain(engine, requests)
        return deltas, text, ids, finished, dict(engine._streams)

    deltas, text, ids, finished, left = run(tiny_chat_model, body, core=core)
    assert not left  # no request's detokenizers outlive it
    logprobs = {}
    for d in deltas:
        for o in d.outputs:
            logprobs.setdefault((d.request_id, o.index), []).extend(o.logprobs or [])
    for (rid, _, params), w in zip(requests, want):
        out = {o.index: o for o in finished[rid].outputs}
        for c in w.outputs:
            key = (rid, c.index)
            assert text[key] == c.text and ids[key] == c.token_ids, key
            if params.logprobs is not None:  # made in the core as before: the same entries, the same decoded tokens
                assert [{t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in logprobs[key]] == \
                       [{t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in c.logprobs], key
                assert [lp.logprob for e in logprobs[key] for lp in e.values()] == \
                       pytest.approx([lp.logprob for e in c.logprobs for lp in e.values()], abs=1e-4)
            if c.index in out:
                assert (out[c.index].finish_reason, out[c.index].stop_reason) == (c.finish_reason, c.stop_reason)


@pytest.mark.parametrize("core", ["thread", "process"])
def test_aborted_request_lets_its_detokenizers_go(tiny_chat_model, oracle, core):
    """A client that leaves mid-stream: its request's detokenizers go with the request's last row
    (finish_reason "abort"), which nobody reads; what it read were LLM.generate's tokens."""
    prompt = oracle.tokenizer.encode("hello")
    long = SamplingParams(temperature=1.0, seed=5, max_tokens=CONTEXT - 10, ignore_eos=True, n=2)

    async def body(engine):
        gen, read = engine.generate("long", prompt, long), {}
        while sum(len(v) for v in read.values()) < 8:
            for o in (await gen.__anext__()).outputs:
                read[o.index] = read.get(o.index, []) + o.token_ids
        await gen.aclose()  # the client went away
        deadline = time.monotonic() + 20
        while engine._streams:
            assert time.monotonic() < deadline, list(engine._streams)
            await asyncio.sleep(0.01)
        return read

    read = run(tiny_chat_model, body, core=core)
    short = oracle.generate({"prompt_token_ids": prompt}, dataclasses.replace(long, max_tokens=8),
                            use_tqdm=False)[0]
    for c in short.outputs:
        n = min(len(read.get(c.index, [])), len(c.token_ids))
        assert read.get(c.index, [])[:n] == c.token_ids[:n]
