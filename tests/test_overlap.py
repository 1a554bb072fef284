"""Chapter 13's overlap scheduling: the step that runs one ahead of its bookkeeping gives every request the
tokens it gets alone, and the device sampler draws what the Sampler draws.

Oracles: chapter 03's one-request path (test_engine.alone), the same engine with overlap off, and the
Sampler (sampler.py) on fresh random logits with broken rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import alone, random_engine_config, random_requests
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.sampling import Sampler, SamplingMetadata
from minillm.sampling.device_sampler import device_samplable, sample_on_device


def _drain(engine, abort_at: int | None = None, aborted=()) -> tuple[dict, int]:
    got, steps, overlapped = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out
        steps += 1
        overlapped += engine._inflight is not None
        if steps == abort_at:
            engine.abort_request(sorted(aborted))
    return got, overlapped


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4))
def test_overlapped_engine_matches_one_request_at_a_time(seed, tok, case):
    """Random mixes (shared prefixes, greedy and seeded top-p, n > 1, stop tokens, aborts, preemption by
    recompute and swap, prefix caching, chunked prompts): overlap on gives the tokens of the request alone."""
    rng = random.Random(seed * 100 + case)
    model, config = random_model(rng)
    requests = random_requests(rng, config.vocab_size, rng.randrange(4, 12))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    ec = random_engine_config(rng, requests, case, async_scheduling=True)
    engine = LLMEngine(model, tok, [], ec)
    aborted = {f"r{i}" for i in range(len(requests)) if rng.random() < 0.15}
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, priority=rng.choice([0, 0, 1]))
    got, overlapped = _drain(engine, 3, aborted)
    assert overlapped > 0  # the overlapped path ran (a bug that silently fell back would pass the rest)
    for i, want in enumerate(expected):
        rid = f"r{i}"
        tokens = [c.token_ids for c in got[rid].outputs] if rid in got else []
        if rid in aborted:
            for g, w in zip(tokens, want):
                assert g == w[: len(g)], (rid, g, w)
            continue
        assert tokens == want, f"{rid}: overlapped engine {tokens} vs alone {want} ({ec})"
    bm = engine.block_manager
    assert not bm.block_tables and not bm.cpu_tables and bm.num_free_blocks == bm.num_blocks - 1
    assert sum(bm.ref_counts) == 0


def test_overlap_on_and_off_agree_with_stop_strings_and_a_host_sampled_request(seed, tok):
    """Overlap on and off give the same outputs (text, tokens, finish reasons) for requests that stop on
    EOS, on a stop string or on max_tokens, while a logprobs request comes and goes: its steps run
    without overlap (the engine drains the step in flight first), the others' with it."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    vocab = config.vocab_size
    eos = [rng.randrange(vocab)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randrange(3, 16), temperature=rng.choice([0.0, 0.8]), seed=i,
                             stop=[tok.decode([rng.randrange(vocab)])] if i % 3 == 0 else [])
              for i in range(6)]
    params[4] = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)  # needs the host's view

    def run(overlap: bool):
        engine = LLMEngine(model, tok, eos, EngineConfig(block_size=4, num_gpu_blocks=128, async_scheduling=overlap,
                                                         max_num_batched_tokens=16))
        out = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if i == 4:  # arrives later, leaves earlier
                for _ in range(3):
                    out |= {o.request_id: o for o in engine.step()}
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        got, overlapped = _drain(engine)
        return {r: [(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for r, o in (out | got).items()}, overlapped

    on, overlapped = run(True)
    off, never = run(False)
    assert on == off and overlapped > 0 and never == 0


def _meta(params, seeds, steps, V):
    return SamplingMetadata.build(params, [[]] * len(params), [[0] * s for s in steps], seeds, [[]] * len(params), V,
                                  "cpu")


def test_device_sampler_draws_what_the_sampler_draws(seed):
    """Fresh random logits, greedy and random rows (temperature, top-k, top-p, min-p), rows holding a NaN,
    rows of -inf but one, +inf: the same token as the Sampler, row for row; a row with no finite value
    gives -1 (the Sampler raises for it)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    R, V = 24, 97
    logits = torch.randn(R, V) * 3
    logits[3, 5] = float("nan")
    logits[7] = float("-inf")
    logits[7, 11] = 0.5
    logits[9, 2] = float("inf")
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5, 40]),
                             top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05])) for _ in range(R)]
    seeds = [rng.randrange(1 << 40) for _ in range(R)]
    steps = [rng.randrange(50) for _ in range(R)]
    want = Sampler()(logits, _meta(params, seeds, steps, V)).token_ids.tolist()
    got = sample_on_device(logits, params, seeds, steps)
    assert got.tolist() == want
    assert got.next_input.tolist() == want
    dead = logits.clone()
    dead[4] = float("nan")
    with pytest.raises(ValueError, match="no finite value"):
        Sampler()(dead, _meta(params, seeds, steps, V))
    out = sample_on_device(dead, params, seeds, steps)
    assert out.tolist()[4] == -1 and out.next_input[4].item() == 0
    assert [t for i, t in enumerate(out.tolist()) if i != 4] == [t for i, t in enumerate(want) if i != 4]


def test_requests_that_need_the_host_are_not_device_sampled():
    assert device_samplable(SamplingParams(temperature=0.5, top_k=3), 0)
    assert not device_samplable(SamplingParams(logprobs=1), 0)
    assert not device_samplable(SamplingParams(repetition_penalty=1.1), 0)
    assert not device_samplable(SamplingParams(presence_penalty=0.5), 0)
    assert not device_samplable(SamplingParams(min_tokens=3), 2)
    assert device_samplable(SamplingParams(min_tokens=3), 3)
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, overlap on the device)")
@pytest.mark.parametrize("case", range(3))
def test_overlapped_engine_on_gpu_with_cuda_graphs(seed, tok, case):
    """On the GPU, with CUDA graphs (decode sizes and token buckets) and overlap on (the default there):
    every request's tokens are its one-request tokens; overlap off gives the same outputs. fp32, so a
    batch shape's GEMM choice cannot flip near-ties."""
    rng = random.Random(seed * 10 + case)
    model, config = random_model(rng)
    model = model.to("cuda")
    requests = random_requests(rng, config.vocab_size, rng.randrange(6, 14))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    outs = []
    for overlap in (None, False):
        engine = LLMEngine(model, tok, [], random_engine_config(rng, requests, case, async_scheduling=overlap,
                                                                cuda_graph_max_batch=16), progress=False)
        assert engine.runner.graphs is not None and engine.async_scheduling is (overlap is None)
        for i, (p, sp) in enumerate(requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        got, overlapped = _drain(engine)
        assert (overlapped > 0) is (overlap is None)
        outs.append({r: [c.token_ids for c in o.outputs] for r, o in got.items()})
        engine.shutdown()
    assert outs[0] == outs[1] == {f"r{i}": want for i, want in enumerate(expected)}


def test_device_sampler_greedy_batches_take_the_short_path(seed):
    """An all-greedy batch (three kernels): the Sampler's tokens on fresh logits with a NaN row, a row of
    -inf but one and a +inf, and -1 for a row of NaN only."""
    torch.manual_seed(seed)
    logits = torch.randn(9, 61) * 4
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[2, 30] = -3.0
    logits[5, 40] = float("inf")
    params = [SamplingParams(temperature=0.0)] * 9
    want = Sampler()(logits, _meta(params, [0] * 9, [0] * 9, 61)).token_ids.tolist()
    assert sample_on_device(logits, params, [0] * 9, [0] * 9).tolist() == want
    logits[4] = float("nan")
    out = sample_on_device(logits, params, [0] * 9, [0] * 9)
    assert out.tolist()[4] == -1 and out.next_input[4].item() == 0
