"""Chapter 09, part two: learned drafters (Medusa heads, an EAGLE layer) change how many tokens a step
emits, never which, and read the target's true hidden states.

Tiny random heads and layers on tiny random models, fresh random inputs: greedy requests through the
speculating engine get the one-request path's tokens (batched, preempted by recompute and swap, prefix
caching, chunked prompts, forks, aborts), and at every step the hidden states the worker keeps for the drafter equal a dense forward of the sequence's tokens.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_engine import alone, blocks_for
from test_spec_engine import drain, random_drafter, repetitive_requests
from tiny_models import random_model

from minillm.engine import EngineConfig, LLMEngine
from minillm.layers import AttentionMetadata


def dense_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The oracle: h of every position, one forward over the whole sequence without a cache."""
    meta = AttentionMetadata.from_seq_lens([len(tokens)], torch.device("cpu"))
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(len(tokens)), meta)  # [n, hidden]


@pytest.mark.parametrize("method, case", [("medusa", 0), ("medusa", 1), ("eagle", 0), ("eagle", 1)])
def test_learned_drafters_match_plain_greedy(seed, tok, method, case):
    rng = random.Random(seed * 100 + case + 7 * len(method))
    model, config = random_model(rng)
    oracle = copy.deepcopy(model)  # never bound to a cache
    requests = repetitive_requests(rng, config.vocab_size, rng.randrange(4, 9))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    k = rng.choice([1, 2, 4])
    block_size = rng.choice([1, 2, 4])
    ec = EngineConfig(block_size=block_size, num_gpu_blocks=blocks_for(requests, block_size) + 6 + rng.randrange(0, 6),
                      num_cpu_blocks=64, preemption_mode=["recompute", "swap"][case],
                      enable_prefix_caching=[None, "hash", "radix"][rng.randrange(3)],
                      max_num_batched_tokens=rng.randrange(8, 40), max_num_seqs=rng.randrange(3, 9),
                      speculative_config={"method": method, "model": random_drafter(method, model, rng, k),
                                          "num_speculative_tokens": k})
    engine = LLMEngine(model, tok, [], ec)
    hs = engine.executor.worker.hidden_states
    checked = 0
    step = engine.step

    def checked_step():  # after each step: what the worker holds for each running sequence is the target's h
        nonlocal checked
        out = step()
        for seq in engine.scheduler.running:
            n = seq.num_computed_tokens
            first, h = hs.gather(seq.seq_id, 0, n - 1)
            if h is not None:
                want = dense_hidden(oracle, seq.token_ids[:n])[first:n]
                torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-4)
                checked += 1
        return out

    engine.step = checked_step
    aborted = {f"r{i}" for i in range(len(requests)) if rng.random() < 0.15}
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got = drain(engine, aborted)
    for i, want in enumerate(expected):
        rid = f"r{i}"
        if rid in aborted:
            for g, w in zip(got.get(rid, []), want):
                assert g == w[: len(g)], (rid, g, w)
            continue
        assert got[rid] == want, f"{rid}: engine {got[rid]} vs alone {want} ({ec})"
    assert engine.engine_stats.spec.num_draft_tokens > 0 and checked > 0
