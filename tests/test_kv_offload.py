"""Chapter 15's KV offload tier (engine/kv_offload.py, cache/offload.py), in seconds: the bookkeeping alone
(LRU order, a full pool, pinned slots, arguments), then the engine with the FakeExecutor, whose "cache" of
token ids makes any restore into the wrong block, from the wrong slot or of a never-written slot change the
tokens or trip its slot check. Every engine test asserts that the CPU path ran (restored blocks, CPU hit
tokens) and that the GPU prefix cache alone did not serve the shared prefix, so none passes without it."""

from __future__ import annotations

import random

import pytest
import torch
from test_fake_executor import VOCAB, alone, fake_engine, run

from minillm import SamplingParams
from minillm.cache.offload import KVOffloadStore, runs
from minillm.engine import EngineConfig
from minillm.engine.kv_offload import KVOffloadPool
from minillm.engine.prefix_cache import chain_keys
from minillm.executor.fake import FakeExecutor

BS = 4


def keys(n: int, seed: int = 0) -> list[bytes]:
    tokens = [random.Random(seed).randrange(VOCAB) for _ in range(n * BS)]
    return list(chain_keys(tokens, BS, n))


# ---- the pool's bookkeeping ---------------------------------------------------------------------------


def test_the_least_recently_used_copy_is_dropped_first():
    pool, k = KVOffloadPool(3, BS), keys(4)
    for block, key in enumerate(k[:3], start=1):
        pool.offload(block, key)
    assert pool.take()[0] == [(1, 0), (2, 1), (3, 2)]  # free slots first, in order
    pool.offload(9, k[0])  # already here: touched (now most recent), no copy
    assert pool.take() == ([], []) and pool.keys() == [k[1], k[2], k[0]]
    pool.offload(4, k[3])  # full: k[1], the least recently used, gives its slot up
    assert pool.take()[0] == [(4, 1)] and pool.keys() == [k[2], k[0], k[3]]
    assert pool.stats.offload_saved_blocks == 4 and pool.stats.offload_dropped_blocks == 1


def test_match_takes_blocks_in_a_row_and_touches_them():
    tokens = [random.Random(1).randrange(VOCAB) for _ in range(5 * BS + 1)]
    k = list(chain_keys(tokens, BS, 5))
    pool = KVOffloadPool(8, BS)
    for block, key in zip((11, 12, 14), (k[1], k[2], k[4])):  # block 3 is missing: the chain stops there
        pool.offload(block, key)
    pool.take()
    assert pool.match(tokens, 1, 5) == [0, 1]
    assert pool.match(tokens, 0, 5) == []  # block 0 is not here: nothing after it counts
    assert pool.keys()[-2:] == [k[1], k[2]]  # the matched ones are the most recent now
    assert pool.match(tokens, 1, 5, extra_key=7) == []  # another adapter's blocks are other K/V


def test_a_slot_matched_this_step_is_never_reused_before_its_restore():
    tokens = [random.Random(2).randrange(VOCAB) for _ in range(2 * BS + 1)]
    k, other = list(chain_keys(tokens, BS, 2)), keys(2, seed=3)
    pool = KVOffloadPool(2, BS)
    pool.offload(5, k[0])
    pool.offload(6, k[1])
    pool.take()
    assert pool.match(tokens, 0, 1) == [0]  # pinned for this step
    pool.offload(7, other[0])  # takes slot 1 (k[1]'s), not the pinned slot 0
    pool.offload(8, other[1])  # slot 1 again (other[0]'s): the pinned slot stays
    assert pool.take()[0] == [(8, 1)] and pool.keys() == [k[0], other[1]]
    one = KVOffloadPool(1, BS)
    one.offload(5, k[0])
    one.take()
    assert one.match(tokens, 0, 1) == [0]
    one.offload(7, other[0])  # its only slot is pinned: this block is dropped, not copied
    assert one.take()[0] == [] and one.stats.offload_dropped_blocks == 1 and one.keys() == [k[0]]
    one.offload(7, other[0])  # a new step: the pin is gone
    assert one.take()[0] == [(7, 0)]


def test_a_slot_saved_twice_in_a_step_keeps_its_last_save():
    pool, k = KVOffloadPool(1, BS), keys(2)
    pool.offload(3, k[0])
    pool.offload(4, k[1])  # a one-slot pool: the same slot again
    assert pool.take()[0] == [(4, 0)] and pool.keys() == [k[1]]


def test_runs_of_consecutive_slots_are_one_copy():
    assert runs([(0, 5), (1, 6), (2, 7), (3, 2), (4, 3), (5, 9)]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: the side stream, pinned memory and events"))])
def test_the_store_copies_every_layer_out_and_back(seed, device):
    """cache/offload.py on fresh random K/V: saved blocks come back bit for bit, in the order the module
    states (a restore reads a slot saved in the same call, into the block just saved). On a GPU the
    copies run on the side stream, and the default stream's next work (the reads here) waits for them."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(6, BS, 2, 8, generator=g), torch.randn(6, BS, 1, 4, generator=g).to(torch.bfloat16)]
    vs = [torch.randn(6, BS, 2, 8, generator=g), None]  # a layer with no separate V (MLA)
    ks, vs = [t.to(device) for t in ks], [t.to(device) if t is not None else None for t in vs]
    before = [t.clone() for t in ks + vs if t is not None]
    store = KVOffloadStore(ks, vs, 4)
    assert store.block_bytes == BS * (2 * 8 * 4 * 2 + 4 * 2)
    store.transfer([(1, 2), (3, 3)], [])
    store.transfer([(4, 0)], [(2, 4), (3, 5), (0, 1)])  # block 4 saved, then overwritten by slot 2's block 1
    after = [t for t in ks + vs if t is not None]
    for b, a in zip(before, after):
        assert torch.equal(a[4], b[1]) and torch.equal(a[5], b[3]) and torch.equal(a[1], b[4])
        assert torch.equal(a[[0, 2, 3]], b[[0, 2, 3]])


# ---- arguments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_offload_gb=-1, enable_prefix_caching="hash"), "kv_offload_gb must be"),
    (dict(kv_offload_gb=float("inf"), enable_prefix_caching="hash"), "kv_offload_gb must be"),
    (dict(kv_offload_gb="1"), "kv_offload_gb must be"),
    (dict(kv_offload_blocks=-2, enable_prefix_caching="hash"), "kv_offload_blocks must be"),
    (dict(kv_offload_blocks=1.5, enable_prefix_caching="hash"), "kv_offload_blocks must be"),
    (dict(kv_offload_blocks=8), "need enable_prefix_caching"),
    (dict(kv_offload_gb=1, enable_prefix_caching="hash", kv_eviction="streaming", kv_budget=64), "kv_eviction"),
])
def test_bad_offload_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_offload_sizes():
    assert not EngineConfig().offloads and EngineConfig(kv_offload_blocks=0).num_offload_blocks(100) == 0
    config = EngineConfig(kv_offload_gb=1, enable_prefix_caching="radix")
    assert config.offloads and config.num_offload_blocks(2**20) == 1024
    with pytest.raises(ValueError, match="holds no block"):
        EngineConfig(kv_offload_gb=1e-9, enable_prefix_caching="hash").num_offload_blocks(2**20)
    with pytest.raises(ValueError, match="give kv_offload_blocks"):  # the fake's blocks have no byte size
        FakeExecutor(EngineConfig(kv_offload_gb=1, enable_prefix_caching="hash"))


# ---- the engine, through the fake executor -------------------------------------------------------------


def shared_prefix_requests(rng: random.Random, prefix_blocks: int, flood: int):
    """A prompt with a shared prefix of prefix_blocks full blocks, `flood` unrelated prompts (they evict
    it from a small GPU pool), then two more prompts with the same prefix."""
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_blocks * BS)]
    greedy = SamplingParams(max_tokens=rng.randrange(2, 6), temperature=0.0)
    out = [(prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))], greedy)]
    out += [([rng.randrange(VOCAB) for _ in range(rng.randrange(20, 32))], greedy) for _ in range(flood)]
    out += [(prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))], greedy) for _ in range(2)]
    return out


def one_by_one(engine, requests) -> dict:
    got = {}
    for i, request in enumerate(requests):
        got.update(run(engine, [request], [str(i)]))
    return got


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_a_prefix_evicted_from_the_gpu_comes_back_from_the_cpu(seed, prefix):
    rng = random.Random(seed)
    blocks = rng.randrange(4, 8)
    requests = shared_prefix_requests(rng, prefix_blocks=blocks, flood=3)
    config = dict(block_size=BS, num_gpu_blocks=14, max_num_seqs=2, max_num_batched_tokens=64,
                  enable_prefix_caching=prefix, async_scheduling=False)
    without = fake_engine(EngineConfig(**config), seed, num_gpu_blocks=14)
    with_offload = fake_engine(EngineConfig(**config, kv_offload_blocks=64), seed, num_gpu_blocks=14)
    expected = alone(requests, seed)  # a roomy engine: nothing is evicted, nothing is cached
    assert one_by_one(without, requests) == expected
    assert one_by_one(with_offload, requests) == expected
    plain, stats = without.engine_stats, with_offload.engine_stats
    # GPU hits: only the last request's, on the blocks its predecessor computed (or restored) just before
    prefix_tokens = blocks * BS
    assert plain.prefix_hit_tokens == stats.prefix_hit_tokens <= prefix_tokens + BS
    # the whole shared prefix of the first request that comes back was restored from the CPU, not recomputed
    assert stats.offload_restored_blocks * BS == stats.offload_hit_tokens >= prefix_tokens
    assert stats.num_prompt_tokens == plain.num_prompt_tokens - stats.offload_hit_tokens


def test_a_restore_into_the_wrong_block_is_caught(seed):
    """Break the executor: restores that copy nothing. The fake's slot check (or the tokens) fail."""
    class LosesRestores(FakeExecutor):
        def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()):
            super().swap_and_copy(swap_out, swap_in, copies, offload_save, ())

    rng = random.Random(seed)
    requests = shared_prefix_requests(rng, prefix_blocks=5, flood=3)
    config = EngineConfig(block_size=BS, num_gpu_blocks=14, max_num_seqs=2, max_num_batched_tokens=64,
                          enable_prefix_caching="hash", async_scheduling=False, kv_offload_blocks=64)
    from minillm.engine import LLMEngine
    from minillm.executor.fake import FakeModel, FakeTokenizer
    engine = LLMEngine(FakeModel(VOCAB), FakeTokenizer(), [], config, progress=False,
                       executor=LosesRestores(config, vocab_size=VOCAB, seed=seed, num_gpu_blocks=14))
    try:
        got = one_by_one(engine, requests)
    except Exception:
        return  # the slot check: a restored block was read before anything was written into it
    assert got != alone(requests, seed) or not engine.engine_stats.offload_restored_blocks


@pytest.mark.parametrize("case", range(4))
def test_a_crowded_engine_with_offload_makes_the_tokens_of_each_request_alone(seed, case):
    """Everything at once: a random mix sharing a prefix, preemption (recompute or swap), chunked prompts,
    overlap scheduling, both prefix caches, a CPU tier small enough to drop blocks too."""
    mode, prefix, overlap = [("recompute", "hash", False), ("swap", "radix", True),
                             ("recompute", "radix", False), ("swap", "hash", True)][case]
    rng = random.Random(seed * 7 + case)
    requests = shared_prefix_requests(rng, prefix_blocks=rng.randrange(3, 7), flood=rng.randrange(2, 5))
    more = shared_prefix_requests(rng, prefix_blocks=3, flood=1)
    requests = requests + more
    need = max(-(-(len(p) + sp.max_tokens + 1) // BS) for p, sp in requests)
    config = EngineConfig(block_size=BS, num_gpu_blocks=need + 2, num_cpu_blocks=64, preemption_mode=mode,
                          enable_prefix_caching=prefix, max_num_seqs=rng.randrange(2, 5),
                          max_num_batched_tokens=rng.randrange(8, 24), async_scheduling=overlap,
                          kv_offload_blocks=rng.randrange(16, 48))
    engine = fake_engine(config, seed, num_gpu_blocks=config.num_gpu_blocks, num_cpu_blocks=64)
    got = run(engine, requests[:2])  # the first two together, then the rest in one batch
    got.update(run(engine, requests[2:], [str(i) for i in range(2, len(requests))]))
    assert got == alone(requests, seed)
    stats = engine.engine_stats
    assert stats.offload_saved_blocks > 0 and stats.offload_restored_blocks > 0, "the CPU tier must serve a hit"
