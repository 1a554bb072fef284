"""Structured output under overlap scheduling (chapters 13 and 14): a step with a grammar queues its forward
pass, then fills its bitmask from the previous step's tokens, then queues its masked sampling; the tokens
are the ones the plain (non-overlapped) step gives.

Oracles: the same engine with async_scheduling off (every output: tokens, text, finish reason), for both
backends, greedy and seeded sampling, n > 1, batches that mix constrained and free requests, preemption;
the order of the host's calls in an overlapped step (the mask is filled after the forward pass was queued
and before the sampling is); and every output in its grammar's language.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from tiny_models import random_model

from minillm.engine import EngineConfig, LLMEngine
from minillm.sampling import SamplingParams
from minillm.structured_output import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
CASES = [("regex", r"\d{2}-[a-z]{2,4}"), ("choice", ["Paris", "London", "Rome"]), ("json", SCHEMA)]


def _backends():
    out = ["minillm"]
    try:
        import xgrammar  # noqa: F401

        out.append("xgrammar")
    except ImportError:
        pass
    return out


def _valid(kind, spec, text) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _requests(rng: random.Random, vocab: int):
    """Each grammar greedy and seeded with n = 2, beside free requests (greedy and seeded)."""
    reqs = []
    for i, (kind, spec) in enumerate(CASES):
        so = StructuredOutputsParams(**{kind: spec})
        reqs.append((f"g{i}", "Answer:", SamplingParams(max_tokens=40, temperature=0, structured_outputs=so), kind, spec))
        reqs.append((f"s{i}", "Say:", SamplingParams(max_tokens=40, temperature=1.0, seed=rng.randrange(1 << 30), n=2,
                                                    structured_outputs=so), kind, spec))
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(2, 9))]}
        reqs.append((f"f{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 12), temperature=rng.choice([0, 0.9]),
                                                     seed=rng.randrange(1 << 30), ignore_eos=True), None, None))
    return reqs


def _run(model, tok, reqs, overlap: bool, backend: str, **config):
    engine = LLMEngine(model, tok, [tok.eos_token_id], EngineConfig(
        block_size=config.pop("block_size", 8), num_gpu_blocks=config.pop("num_gpu_blocks", 256), async_scheduling=overlap,
        structured_outputs_backend=backend, **config), progress=False)
    for rid, prompt, sp, _, _ in reqs:
        engine.add_request(rid, prompt, sp)
    got, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o
        overlapped += engine._inflight is not None and bool(engine.structured.matchers)
    assert not engine.structured.matchers  # every finished sequence's matcher is gone
    outs = {r: [(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for r, o in got.items()}
    return outs, overlapped, engine


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
def test_overlap_on_and_off_give_the_same_constrained_outputs(seed, tok, backend):
    rng = random.Random(seed)
    model, _ = random_model(rng, vocab_size=len(tok.vocab))
    reqs = _requests(rng, len(tok.vocab))
    on, overlapped, _ = _run(model, tok, reqs, True, backend)
    off, never, _ = _run(model, tok, reqs, False, backend)
    assert overlapped > 0 and never == 0  # the constrained requests ran overlapped, and only with it on
    assert on == off
    for rid, _, _, kind, spec in reqs:
        for text, _, reason in on[rid]:
            if kind is not None:
                assert reason == "stop" and _valid(kind, spec, text), (rid, text, reason)


@pytest.mark.slow
def test_overlap_with_grammars_under_preemption(seed, tok):
    """A pool too small for the batch: sequences are preempted (recomputed) mid-grammar; the matchers
    follow their tokens, and overlap on gives what overlap off gives."""
    rng = random.Random(seed + 1)
    model, _ = random_model(rng, vocab_size=len(tok.vocab))
    reqs = _requests(rng, len(tok.vocab))
    on, overlapped, engine = _run(model, tok, reqs, True, "minillm", block_size=2, num_gpu_blocks=26,
                                  max_num_batched_tokens=32)
    assert engine.engine_stats.num_preemptions > 0 and overlapped > 0
    off, _, _ = _run(model, tok, reqs, False, "minillm", block_size=2, num_gpu_blocks=26,
                                  max_num_batched_tokens=32)
    assert on == off


def test_an_overlapped_grammar_step_fills_its_mask_between_forward_and_sampling(seed, tok):
    """The host's order in a step with a grammar: forward pass queued (the worker keeps the logits),
    then the previous step's tokens read and accepted, the mask filled, then the sampling queued; and
    the steps of a constrained request stay overlapped after its first token."""
    rng = random.Random(seed)
    model, _ = random_model(rng, vocab_size=len(tok.vocab))
    engine = LLMEngine(model, tok, [tok.eos_token_id], EngineConfig(block_size=8, num_gpu_blocks=64,
                                                                    async_scheduling=True))
    calls, ex, so = [], engine.executor, engine.structured

    def spy(obj, name):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            out = real(*a, **k)
            calls.append((name, out is None) if name == "execute_model" else name)
            return out
        setattr(obj, name, wrapped)

    for obj, name in ((ex, "execute_model"), (ex, "sample_tokens"), (so, "accept"), (so, "bitmask")):
        spy(obj, name)
    sp = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{8,12}"))
    engine.add_request("r", "Word:", sp)
    text = ids = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            text, ids = (o.outputs[0].text, o.outputs[0].token_ids) if o.finished else (text, ids)
    assert re.fullmatch(r"[a-z]{8,12}", text)
    # each step: execute_model deferred (None), accept (the previous token; none before the first), bitmask, sample
    steps = [i for i, c in enumerate(calls) if c == ("execute_model", True)]
    assert len(steps) >= len(ids) >= 2 and ("execute_model", False) not in calls  # every token's step deferred
    for n, i in enumerate(steps):
        end = steps[n + 1] if n + 1 < len(steps) else len(calls)
        seq = calls[i + 1:end]
        want = (["accept"] if n else []) + ["bitmask", "sample_tokens"]
        assert seq[:len(want)] == want, (n, seq)


def test_sample_tokens_without_a_deferred_step_is_an_error(seed, tok):
    rng = random.Random(seed)
    model, _ = random_model(rng, vocab_size=len(tok.vocab))
    engine = LLMEngine(model, tok, [tok.eos_token_id], EngineConfig(block_size=8, num_gpu_blocks=32))
    with pytest.raises(ValueError, match="no step is waiting"):
        engine.executor.sample_tokens(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, pinned uploads, Triton)")
@pytest.mark.parametrize("backend", _backends())
def test_overlapped_grammars_on_gpu_with_cuda_graphs(seed, tok, backend):
    """On the GPU (CUDA graphs, the mask from pinned memory, the Triton apply kernel, the device sampler):
    overlap on (the default there) gives the outputs of overlap off, every constrained output valid. fp32,
    so a batch shape's GEMM choice cannot flip near-ties."""
    rng = random.Random(seed)
    model, _ = random_model(rng, vocab_size=len(tok.vocab))
    model = model.to("cuda")
    reqs = _requests(rng, len(tok.vocab))
    outs = []
    for overlap in (None, False):
        got, overlapped, engine = _run(model, tok, reqs, overlap, backend, cuda_graph_max_batch=16)
        assert engine.runner.graphs is not None and (overlapped > 0) is (overlap is None)
        outs.append(got)
        engine.shutdown()
    assert outs[0] == outs[1]
    for rid, _, _, kind, spec in reqs:
        for text, _, reason in outs[0][rid]:
            if kind is not None:
                assert reason == "stop" and _valid(kind, spec, text), (rid, text, reason)
