"""Chapter 15's KV offload tier with a real model and cache (worker/, cache/offload.py), on fresh random tiny
Llama-shaped models on the CPU: a GPU pool too small to keep a shared prefix between requests, so the prefix
is evicted; with the offload tier it comes back from the CPU pool (the counters say so, and the GPU prefix
cache found nothing), and the greedy tokens equal both a roomy engine's (nothing evicted) and those of the
same small engine without the tier (recomputed)."""

from __future__ import annotations

import random

import pytest
import torch

from minillm.bench.serving_setup import NoTextTokenizer
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.loader import load_model
from minillm.sampling import SamplingParams

BS, VOCAB = 4, 128


def tiny(seed: int, kv_heads: int = 2):
    """A 2-layer random Llama-shaped model, fp32; weights drawn from seed (large: clear greedy winners)."""
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=256,
                      name="kv-offload-random")
    model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
    return model


def one_by_one(model, prompts, max_tokens, **config):
    """Greedy tokens of each prompt, one request at a time (so the pool's contents between requests
    decide what is cached), and the engine."""
    engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(**config), progress=False)
    got = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                            ignore_eos=True))
        while engine.has_unfinished_requests():
            got += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    return got, engine


def shared_prefix_prompts(rng: random.Random, prefix_blocks: int):
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_blocks * BS)]
    flood = [[rng.randrange(VOCAB) for _ in range(rng.randrange(24, 32))] for _ in range(2)]
    tail = lambda: [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
    return [prefix + tail(), *flood, prefix + tail()]


@pytest.mark.slow  # three engines of a real (tiny) model, request by request: ~5-10 s on 2 cores
@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_a_prefix_restored_from_the_cpu_gives_the_tokens_of_a_roomy_engine(seed, prefix):
    model = tiny(seed)
    rng = random.Random(seed)
    blocks = rng.randrange(4, 7)
    prompts = shared_prefix_prompts(rng, blocks)
    small = dict(block_size=BS, num_gpu_blocks=12, max_num_batched_tokens=rng.choice([8, 64]),  # 8: chunked
                 enable_prefix_caching=prefix)
    roomy, _ = one_by_one(model, prompts, 6, block_size=BS, num_gpu_blocks=200, enable_prefix_caching=None)
    plain, without = one_by_one(model, prompts, 6, **small)
    got, engine = one_by_one(model, prompts, 6, **small, kv_offload_blocks=32)
    assert got == roomy and plain == roomy
    stats, block_bytes = engine.engine_stats, engine.sizes.block_bytes
    assert without.engine_stats.prefix_hit_tokens == stats.prefix_hit_tokens == 0, "evicted from the GPU"
    assert stats.offload_hit_tokens == stats.offload_restored_blocks * BS >= blocks * BS
    assert stats.offload_bytes_to_gpu == stats.offload_restored_blocks * block_bytes > 0
    assert stats.offload_bytes_to_cpu == stats.offload_saved_blocks * block_bytes
    assert stats.num_prompt_tokens == without.engine_stats.num_prompt_tokens - stats.offload_hit_tokens
    assert block_bytes == 2 * 2 * BS * 2 * 8 * 4  # K and V x layers x tokens x kv heads x head_dim x fp32


def test_kv_offload_gb_sizes_the_pool_by_bytes(seed):
    model = tiny(seed)
    engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(block_size=BS, num_gpu_blocks=12,
                       enable_prefix_caching="hash", kv_offload_gb=10 * 1024 / 2**30), progress=False)
    assert engine.sizes.block_bytes == 1024 and engine.block_manager.offload.num_slots == 10
    assert engine.executor.worker.runner.offload.pool.shape == (10, 1024)


def test_offload_refuses_a_model_whose_windows_free_blocks(seed):
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, sliding_windows=[8, 8])
    model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_eviction='none'"):
        LLMEngine(model, NoTextTokenizer(), [], EngineConfig(block_size=BS, num_gpu_blocks=12,
                  enable_prefix_caching="hash", kv_offload_blocks=4), progress=False)


@pytest.mark.slow  # two worker processes (gloo on the CPU)
def test_tensor_parallel_ranks_each_offload_their_own_shard(tmp_path, seed):
    """TP=2: every rank copies its half of the heads out and back (the same slots); the tokens are TP=1's
    with the tier on (up to fp32 near-ties, test_tp_engine's tolerance), and the CPU tier served the prefix."""
    from test_tp_engine import _greedy, assert_tokens_until_ties
    from tiny_models import VOCAB as TP_VOCAB
    from tiny_models import make_tiny

    from minillm import LLM

    path = make_tiny("llama3", tmp_path, vocab_size=TP_VOCAB + 3)
    rng = random.Random(seed)
    prefix = [rng.randrange(TP_VOCAB) for _ in range(5 * BS)]
    prompts = [prefix + [1, 2], *([rng.randrange(TP_VOCAB) for _ in range(28)] for _ in range(2)), prefix + [3]]
    engine = dict(device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=48, block_size=BS,
                  num_gpu_blocks=12, enable_prefix_caching="hash", kv_offload_blocks=32)
    outs = {}
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, **engine) as llm:
            outs[tp] = [_greedy(llm, [{"prompt_token_ids": p}], 6, logprobs=2 if tp == 1 else None)[0] for p in prompts]
            stats = llm.engine.engine_stats
            assert stats.offload_restored_blocks >= 5 and stats.prefix_hit_tokens == 0
    assert_tokens_until_ties(outs[1], outs[2], 6)
