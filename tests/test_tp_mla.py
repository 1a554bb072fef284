"""Latent attention (layers/mla.py) split by heads across tensor-parallel ranks (chapter 11).

Layer oracle, in one process (simulate_tensor_parallel): each rank builds its shard, loads the one
full set of random weights through the layers' weight_loaders, and runs the same inputs; o_proj's
all-reduce returns the rank's partial sum, so the ranks' outputs summed must equal the unsharded
layer's, on the naive path (no cache) and on the absorbed one (a prefill chunk, a second chunk and
decodes through each rank's own paged latent cache). Model oracle: a tiny DeepSeek-V2 / V3
checkpoint whose every layer is dense (first_k_dense_replace = num_hidden_layers: routed experts
shard in layers/moe.py, not here) at TP = 2 in spawned gloo processes gives TP = 1's logits and
greedy tokens (tests/test_tp_model.py's check), and through LLM (the engine's paged latent cache on
each rank, prefix hits, preemption) TP = 1's greedy tokens (tests/test_tp_engine.py's check).

Tolerance (layer): a rank computes its heads' dot products exactly as the full layer does; only
o_proj's sum over H * V = 96 inputs is split into tp partial sums, and the column-parallel GEMMs may
block their K <= 48 terms differently. fp32 reordering of K terms moves a result by at most
K * eps = 1.1e-5 of sum |x_k w_k|, and on random data the error is a random walk far below that:
1e-5 relative (Frobenius) is test_mla.py's bound for the same layer, and holds here with margin.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_kernels_moe import rel
from test_mla import mla_config, run_cached
from test_tp_engine import ENGINE, _greedy, _prompts, assert_tokens_until_ties
from test_tp_model import check_tp_equals_tp1
from tiny_models import make_tiny

from minillm import LLM
from minillm.cache import kv_cache_spec
from minillm.config import MoEConfig
from minillm.distributed import check_tensor_parallel_size, simulate_tensor_parallel, tensor_parallel_sizes
from minillm.layers import AttentionMetadata
from minillm.layers.backend import kernel_mode
from minillm.layers.mla import DeepseekRotaryEmbedding, MultiHeadLatentAttention

NUM_HEADS = 4  # splits at 1, 2, 4


def full_weights(layer: MultiHeadLatentAttention, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh random weights for an unsharded layer (norms near 1, projections ~ 1/sqrt(fan-in))."""
    return {name: 1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
            else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 for name, p in layer.named_parameters()}


def load_shard(layer: MultiHeadLatentAttention, weights: dict[str, torch.Tensor]) -> None:
    """Each parameter takes its part of the full tensor through its own loader (the model loader's way)."""
    for name, p in layer.named_parameters():
        loader = getattr(p, "weight_loader", None)
        loader(p, weights[name]) if loader is not None else p.data.copy_(weights[name])


def shards(config, tp: int, weights) -> list[MultiHeadLatentAttention]:
    out = []
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            layer = MultiHeadLatentAttention(config, prefix="model.layers.0.self_attn")
        load_shard(layer, weights)
        out.append(layer)
    return out


CONFIGS = {  # no q LoRA (V2-Lite) / q LoRA with YaRN (V2, V3); biases on the replicated and row-parallel layers
    "q_proj": dict(q_lora_rank=None, yarn=False),
    "q_lora-yarn": dict(q_lora_rank=12, yarn=True),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_ranks_summed_equal_the_unsharded_layer(seed, name, tp):
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    config = mla_config(**CONFIGS[name]).with_(num_heads=NUM_HEADS, num_kv_heads=NUM_HEADS, qkv_bias=True, o_bias=True)
    full = MultiHeadLatentAttention(config)
    weights = full_weights(full, g)
    load_shard(full, weights)
    parts = shards(config, tp, weights)
    for r, layer in enumerate(parts):  # this rank's heads, whole: q_b/kv_b rows and o_proj columns
        H = NUM_HEADS // tp
        assert layer.num_heads == H and layer.attn.num_heads == H
        assert layer.kv_b_proj.weight.shape == (H * (layer.P + layer.V), layer.L)
        assert layer.o_proj.weight.shape == (config.hidden_size, H * layer.V)
        w_uk, w_uv = layer._w_uk_uv()
        full_uk, full_uv = full._w_uk_uv()  # [H, P, L], [H, V, L]
        assert torch.equal(w_uk, full_uk[r * H:(r + 1) * H]) and torch.equal(w_uv, full_uv[r * H:(r + 1) * H])
        # the latent is every rank's: the replicated down-projection and the whole cache row
        assert torch.equal(layer.kv_a_proj_with_mqa.weight, full.kv_a_proj_with_mqa.weight)
        assert layer.attn.kv_cache_spec(torch.float32) == full.attn.kv_cache_spec(torch.float32)

    rope = DeepseekRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling)
    n = rng.randint(16, 30)
    x = torch.randn(n, config.hidden_size, generator=g)
    pos = torch.arange(n)
    first = rng.randint(1, n - 6)
    chunks = [first, n - first - 4, 1, 1, 1, 1]  # prefill, a chunk over cached keys, four decodes
    with kernel_mode("torch"):
        meta = AttentionMetadata.from_seq_lens([n], "cpu")
        naive = full(pos, x, meta, rope.cos_sin(pos, x.dtype))
        summed = sum(layer(pos, x, meta, rope.cos_sin(pos, x.dtype)) for layer in parts)
        assert rel(summed, naive) < 1e-5, rel(summed, naive)
        # the absorbed path with each rank's own cache (and its own shuffled block layout)
        full_absorbed = run_cached(full, rope, x, chunks, rng.choice([1, 4]), g)
        assert rel(full_absorbed, naive) < 1e-5
        absorbed = sum(run_cached(layer, rope, x, chunks, rng.choice([1, 4]), g) for layer in parts)
        assert rel(absorbed, full_absorbed) < 1e-5, rel(absorbed, full_absorbed)


@torch.inference_mode()
def test_absorbed_shards_on_the_triton_kernel(seed):
    """One TP = 2 case through the paged MLA kernel (Triton's interpreter on a CPU): a rank's query
    carries H / tp heads, the kernel's head count is whatever the query has."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    config = mla_config(12, yarn=True).with_(num_heads=NUM_HEADS, num_kv_heads=NUM_HEADS)
    full = MultiHeadLatentAttention(config)
    weights = full_weights(full, g)
    load_shard(full, weights)
    rope = DeepseekRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling)
    n = rng.randint(10, 16)
    x = torch.randn(n, config.hidden_size, generator=g)
    chunks = [n - 2, 1, 1]
    with kernel_mode("torch"):
        want = run_cached(full, rope, x, chunks, 4, g)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # the kernel natively on a GPU
    with kernel_mode("triton"):
        got = sum(run_cached(layer.to(dev), rope.to(dev), x.to(dev), chunks, 4, g).cpu()
                  for layer in shards(config, 2, weights))
    assert rel(got, want) < 1e-5, rel(got, want)


def test_a_size_that_does_not_divide_the_heads_is_refused():
    # 6 heads at tp = 4: the features (6 x 40 kv_b rows, 6 x 24 q rows) would divide, the heads do not
    config = mla_config().with_(num_heads=6, num_kv_heads=6)
    with simulate_tensor_parallel(0, 4), pytest.raises(ValueError) as e:
        MultiHeadLatentAttention(config, prefix="model.layers.3.self_attn")
    for words in ("tensor_parallel_size 4", "6 query heads", "model.layers.3.self_attn", "sizes up to 16 that do: "
                  "1, 2, 3, 6"):
        assert words in str(e.value), (words, str(e.value))
    with simulate_tensor_parallel(1, 3):
        assert MultiHeadLatentAttention(config).num_heads == 2


def test_tensor_parallel_sizes_of_latent_attention():
    """MLA splits at what divides its query heads (and the dense FFN); its KV-head count is no constraint
    (the latent is replicated), and a rank's cache spec is the whole latent (L + R = 40) at any size."""
    config = mla_config().with_(num_heads=12, num_kv_heads=3, intermediate_size=48)
    assert tensor_parallel_sizes(config) == [1, 2, 3, 4, 6, 12]  # a Llama config with 3 KV heads: 1, 3, 6, 12
    check_tensor_parallel_size(config, 4)
    with pytest.raises(ValueError, match="sizes that do: 1, 2, 3, 4, 6, 12"):
        check_tensor_parallel_size(config, 5)
    routed = config.with_(moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    assert tensor_parallel_sizes(routed) == [1, 2, 4]  # and each routed expert splits its 16 features
    specs = {}
    for tp in (1, 4):
        with simulate_tensor_parallel(0, tp):
            specs[tp] = kv_cache_spec(config, torch.bfloat16)
    assert specs[1] == specs[4] and [(s.num_kv_heads, s.head_size, s.has_v) for s in specs[4]] == [(1, 40, False)]


MODEL_CASES = {
    # every layer dense (first_k_dense_replace = the 2 layers): latent attention alone
    "deepseek_v2-dense-tp2": ("deepseek_v2", 2, dict(first_k_dense_replace=2)),  # q_proj, YaRN, interleaved RoPE
    "deepseek_v3-dense-tp2": ("deepseek_v3", 2, dict(first_k_dense_replace=2)),  # q LoRA
    # layer 1 routed + shared experts (tests/test_tp_moe.py): MLA and MoE sharded together
    "deepseek_v2-tp2": ("deepseek_v2", 2, {}),  # group-limited softmax routing
    "deepseek_v3-tp2": ("deepseek_v3", 2, {}),  # sigmoid routing with a correction bias
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_deepseek_at_tp2_equals_tp1(case, seed, tmp_path):
    check_tp_equals_tp1(case, *MODEL_CASES[case], seed, tmp_path)


@pytest.mark.slow
def test_dense_deepseek_engine_at_tp2_makes_the_tokens_of_tp1(seed, tmp_path):
    """Through LLM: each rank's paged latent cache (the whole latent, per rank), batching, chunked
    prompts, prefix hits and preemption, as test_tp_engine.py checks a Llama model."""
    folder = make_tiny("deepseek_v2", tmp_path / "deepseek_v2", first_k_dense_replace=2)
    prompts, steps = _prompts(seed), 16
    with LLM(folder, **ENGINE) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    with LLM(folder, tensor_parallel_size=2, **ENGINE) as llm:
        got = _greedy(llm, prompts, steps)
        stats = llm.engine.engine_stats
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, "the run must exercise both"
    assert_tokens_until_ties(want, got, steps)
