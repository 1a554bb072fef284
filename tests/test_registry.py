"""A model family is one file plus a registry line: a test-only architecture, registered here, runs
through the loader, the KV-cache spec and the serving engine with no edit to any of them."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import alone

from minillm import SamplingParams
from minillm.cache import KVCacheSpec, kv_cache_spec
from minillm.config import ModelConfig, preset
from minillm.engine import EngineConfig, LLMEngine
from minillm.loader import load_model
from minillm.models import get_model_class, model_type_of, register_model
from minillm.models.llama import LlamaForCausalLM


class TinyTestForCausalLM(LlamaForCausalLM):
    """A second architecture: Llama's layers, but its logits are soft-capped (Gemma-2 style)."""

    def compute_logits(self, hidden):
        return 30.0 * torch.tanh(super().compute_logits(hidden) / 30.0)


register_model("tiny_test", TinyTestForCausalLM, hf_architectures=("TinyTestForCausalLM",))


def _config(**kw):
    return ModelConfig(architecture="tiny_test", vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, **kw)


def test_a_registered_architecture_is_found_by_every_reader():
    assert get_model_class("tiny_test") is TinyTestForCausalLM
    assert model_type_of(["TinyTestForCausalLM"]) == "tiny_test"
    cfg = ModelConfig.from_hf({"architectures": ["TinyTestForCausalLM"], "hidden_size": 48, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97})
    assert cfg.architecture == "tiny_test"
    with pytest.raises(ValueError, match="not supported"):
        get_model_class("no-such-family")
    with pytest.raises(ValueError, match="model_cls must be"):
        register_model("x", "no_colon")


def test_num_params_comes_from_the_built_model():
    model, config, _ = load_model(_config(), load_format="dummy")
    assert config.num_params == sum(p.numel() for p in model.parameters())
    tied = preset("smollm2-135m")
    assert tied.num_params == 134_515_008  # the embedding counted once


@torch.inference_mode()
def test_the_engine_serves_a_new_family_unchanged(seed, tok):
    rng = random.Random(seed)
    model, _, _ = load_model(_config(), load_format="dummy")
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3, generator=gen)
    assert kv_cache_spec(model) == [KVCacheSpec(2, 16, torch.float32)] * 2
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=8))
    requests = [([rng.randrange(97) for _ in range(rng.randrange(2, 14))],
                 SamplingParams(max_tokens=rng.randrange(1, 8), temperature=rng.choice([0.0, 0.9]), seed=i))
                for i in range(5)]
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    assert [got[f"r{i}"] for i in range(5)] == [alone(model, tok, p, sp) for p, sp in requests]


def test_paged_pool_follows_a_mixed_spec():
    """An MLA-like layer (one latent per token, no V) beside an ordinary one: the pool allocates, sizes,
    copies and swaps each as its spec says."""
    from minillm.cache import PagedKVCache

    specs = [KVCacheSpec(1, 40, torch.bfloat16, has_v=False), KVCacheSpec(2, 16, torch.float32)]
    cache = PagedKVCache(specs, num_blocks=6, block_size=4, device="cpu", num_cpu_blocks=3)
    assert [tuple(k.shape) for k in cache.k_caches] == [(6, 4, 1, 40), (6, 4, 2, 16)]
    assert cache.v_caches[0] is None and cache.v_caches[1].dtype == torch.float32
    assert cache.bytes_per_token == 40 * 2 + 2 * 2 * 16 * 4 == PagedKVCache.block_bytes(specs, 4) // 4
    assert cache.nbytes == cache.bytes_per_token * 6 * 4
    for t in (cache.k_caches[0], cache.k_caches[1], cache.v_caches[1]):
        t.normal_()
    latent = cache.k_caches[0][2].clone()
    cache.copy_blocks([(2, 5)])
    cache.swap_out([(2, 1)])
    cache.k_caches[0][2].zero_()
    cache.swap_in([(1, 2)])
    assert torch.equal(cache.k_caches[0][5], latent) and torch.equal(cache.k_caches[0][2], latent)
