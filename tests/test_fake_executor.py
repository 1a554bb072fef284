"""The engine's oracle in seconds (issue 42, item 7): with the FakeExecutor (a KV "cache" of token ids and a
fixed random next-token function of the tokens a row reads back), a random mix of requests through a
tiny pool (preemption by recompute and swap), a small token budget (chunked prompts), both prefix caches,
n-gram drafts and overlap scheduling gets, request by request, the tokens it gets alone in a roomy engine
with none of those. Any block-table, swap, prefix-cache or rollback mistake changes what a row reads, so
it changes the tokens or trips the fake's own slot check; the last tests break the engine on purpose to
show that."""

from __future__ import annotations

import dataclasses
import random

import pytest

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.executor.fake import FakeExecutor, FakeModel, FakeTokenizer
from minillm.spec_decode import SpeculativeConfig

VOCAB = 64


def fake_engine(config: EngineConfig, seed: int, **sizes) -> LLMEngine:
    executor = FakeExecutor(config, vocab_size=VOCAB, seed=seed, **sizes)
    return LLMEngine(FakeModel(VOCAB), FakeTokenizer(), [], config, progress=False, executor=executor)


def random_requests(rng: random.Random, count: int) -> list[tuple[list[int], SamplingParams]]:
    system = [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 30))]  # a shared "system prompt"
    out = []
    for i in range(count):
        # repeats inside a prompt give the n-gram drafter something to find
        own = [rng.randrange(8) if rng.random() < 0.5 else rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))]
        seeded = rng.random() < 0.4
        params = SamplingParams(max_tokens=rng.randrange(1, 24), n=rng.choice([1, 1, 2, 3]),
                                temperature=0.8 if seeded else 0.0, seed=rng.randrange(1 << 30) if seeded else None,
                                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else [],
                                logprobs=rng.choice([None, None, 2]))
        out.append(((system if i < 3 or rng.random() < 0.5 else []) + own, params))
    return out


def run(engine: LLMEngine, requests, ids=None) -> dict[str, list]:
    """-> request id -> [(token ids, text, finish reason, logprobs)] per completion."""
    ids = ids or [str(i) for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs]
    return done


def alone(requests, seed: int) -> dict[str, list]:
    """Each request by itself, one at a time, in a roomy engine: no preemption, no prefix cache, no drafts,
    no overlap, whole prompts in one step."""
    engine = fake_engine(EngineConfig(block_size=4, num_gpu_blocks=200, max_num_seqs=4, max_num_batched_tokens=256,
                                      enable_prefix_caching=None, async_scheduling=False), seed, num_gpu_blocks=200)
    out = {}
    for i, request in enumerate(requests):
        out.update(run(engine, [request], [str(i)]))
    return out


CASES = [  # (preemption, prefix cache, drafts, overlap)
    ("recompute", None, 0, False), ("swap", "hash", 0, False), ("recompute", "radix", 0, True),
    ("swap", None, 3, False), ("recompute", "hash", 2, True), ("swap", "radix", 3, False),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_crowded_engine_makes_the_tokens_of_each_request_alone(seed, case):
    mode, prefix, drafts, overlap = CASES[case]
    rng = random.Random(seed * 31 + case)
    requests = random_requests(rng, rng.randrange(6, 14))
    if drafts:  # a sampled token under drafts has the target's distribution, not plain sampling's draw
        requests = [(p, dataclasses.replace(sp, temperature=0.0, seed=None)) for p, sp in requests]
    block_size = rng.choice([1, 2, 4, 8])
    need = max(-(-(len(p) + sp.max_tokens + drafts + 1) // block_size) for p, sp in requests)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=3) if drafts else None
    config = EngineConfig(block_size=block_size, num_gpu_blocks=need + 1 + rng.randrange(0, 3), num_cpu_blocks=256,
                          preemption_mode=mode, enable_prefix_caching=prefix, max_num_seqs=rng.randrange(4, 8),
                          max_num_batched_tokens=rng.randrange(8, 40), speculative_config=spec,
                          async_scheduling=overlap)
    engine = fake_engine(config, seed, num_gpu_blocks=config.num_gpu_blocks, num_cpu_blocks=256)
    got = run(engine, requests)
    stats = engine.engine_stats
    assert got == alone(requests, seed)
    assert stats.num_preemptions > 0, "the pool must be small enough to preempt"
    if prefix is not None:
        assert stats.prefix_hit_tokens > 0, "shared prefixes must be found"
    if drafts:
        assert stats.spec.num_accepted_tokens > 0, "some drafts must be accepted (and some rolled back)"


def test_a_lost_swap_is_caught(seed):
    """Break the executor: swap-ins that do nothing. The fake's slot check fails the requests that read
    a block never filled again (finish reason "error"), or the tokens differ from alone."""
    class LosesSwaps(FakeExecutor):
        def swap_and_copy(self, swap_out, swap_in, copies):
            super().swap_and_copy(swap_out, [], copies)

    rng = random.Random(seed)
    requests = [([rng.randrange(VOCAB) for _ in range(10)], SamplingParams(max_tokens=20)) for _ in range(6)]
    config = EngineConfig(block_size=2, num_gpu_blocks=18, num_cpu_blocks=64, preemption_mode="swap",
                          max_num_seqs=6, max_num_batched_tokens=32, async_scheduling=False)
    engine = LLMEngine(FakeModel(VOCAB), FakeTokenizer(), [], config, progress=False,
                       executor=LosesSwaps(config, vocab_size=VOCAB, seed=seed, num_gpu_blocks=18, num_cpu_blocks=64))
    got = run(engine, requests)
    assert engine.engine_stats.num_preemptions > 0
    assert got != alone(requests, seed)


def test_a_wrong_prefix_hit_is_caught(seed, monkeypatch):
    """Break the prefix cache: every block's key ignores its tokens, so a prompt reuses another prompt's
    blocks. The slot check passes (the positions are right) but the tokens read back are not this
    prompt's: the outputs differ from alone."""
    from minillm.engine import prefix_cache

    rng = random.Random(seed)
    requests = [([rng.randrange(VOCAB) for _ in range(12)], SamplingParams(max_tokens=6)) for _ in range(4)]
    monkeypatch.setattr(prefix_cache, "block_tokens", lambda ids, size, n: [(0,) * size] * n)
    config = EngineConfig(block_size=4, num_gpu_blocks=60, enable_prefix_caching="hash", max_num_seqs=4,
                          max_num_batched_tokens=64, async_scheduling=False)
    engine = fake_engine(config, seed, num_gpu_blocks=60)
    got = {}
    for i, request in enumerate(requests):  # one after another: each later prompt "hits" the first's blocks
        got.update(run(engine, [request], [str(i)]))
    assert engine.engine_stats.prefix_hit_tokens > 0
    monkeypatch.undo()
    assert got != alone(requests, seed)
