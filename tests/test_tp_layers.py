"""Chapter 11's layer oracle, in one process: build each rank's shard of a layer (simulate_tensor_parallel),
load the one full checkpoint tensor through its weight_loader, and check that the ranks' outputs,
concatenated (column-parallel, vocabulary-parallel) or summed (row-parallel), give the unsharded layer.
The collectives of a simulated rank return its own part; the test does the concatenating and summing.

Tolerance: a shard computes the same dot products as the full layer (column, vocab) or splits each
dot product's K terms into tp partial sums (row); either way fp32 reordering moves a result by at most
K * eps * sum_k |x_k w_k| (the classic bound for a sum of K products), which is what `bound` returns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minillm.distributed import (
    check_tensor_parallel_size,
    get_tensor_model_parallel_world_size,
    simulate_tensor_parallel,
    tensor_parallel_sizes,
)
from minillm.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minillm.layers.moe import FusedMoE
from minillm.layers.quantization import GGUFConfig, get_quantization_config

EPS = torch.finfo(torch.float32).eps


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output element: K * eps * |x| @ |w|^T (+ a floor for exact zeros)."""
    return x.shape[-1] * EPS * (x.abs() @ w.abs().T) + 1e-30


def ranks(tp: int, build):
    """build() as each rank of tp: the list of rank layers."""
    out = []
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            out.append(build())
    return out


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor) if shard_id is None else param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_concat_is_the_full_layer(tp, seed):
    torch.manual_seed(seed)
    N, K = 24, 40
    w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(7, K)
    full = x @ w.T + b
    parts = []
    for layer in ranks(tp, lambda: ColumnParallelLinear(K, N, bias=True)):
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert layer.weight.shape == (N // tp, K)
        parts.append(layer(x))  # [T, N / tp]
    assert ((torch.cat(parts, -1) - full).abs() <= bound(x, w)).all()


@pytest.mark.parametrize("tp", [2, 4])
def test_merged_column_parallel_holds_each_parts_slice(tp, seed):
    torch.manual_seed(seed)
    I, K = 16, 24
    gate, up, x = torch.randn(I, K), torch.randn(I, K), torch.randn(5, K)
    gates, ups = [], []
    for layer in ranks(tp, lambda: MergedColumnParallelLinear(K, [I, I])):
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        g, u = layer(x).split(I // tp, dim=-1)  # [T, I/tp] each: this rank's gate rows, then its up rows
        gates.append(g), ups.append(u)
    assert ((torch.cat(gates, -1) - x @ gate.T).abs() <= bound(x, gate)).all()
    assert ((torch.cat(ups, -1) - x @ up.T).abs() <= bound(x, up)).all()


@pytest.mark.parametrize("tp, replicas", [(2, 1), (4, 2), (8, 4)])
def test_qkv_parallel_heads_and_kv_replication(tp, replicas, seed):
    """8 query heads and 2 KV heads: at tp = 2 each rank holds one KV head; at tp 4 and 8 each KV head
    is replicated on tp/2 ranks, and rank r holds the KV head its query heads attend with."""
    torch.manual_seed(seed)
    Hq, Hkv, D, K = 8, 2, 4, 16
    wq, wk, wv = torch.randn(Hq * D, K), torch.randn(Hkv * D, K), torch.randn(Hkv * D, K)
    bq, bk, bv = torch.randn(Hq * D), torch.randn(Hkv * D), torch.randn(Hkv * D)
    x = torch.randn(6, K)
    q_full = (x @ wq.T + bq).view(6, Hq, D)
    k_full = (x @ wk.T + bk).view(6, Hkv, D)
    v_full = (x @ wv.T + bv).view(6, Hkv, D)
    for r, layer in enumerate(ranks(tp, lambda: QKVParallelLinear(K, D, Hq, Hkv, bias=True))):
        assert (layer.num_heads, layer.num_kv_head_replicas) == (Hq // tp, replicas)
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            load(layer, "weight", w, shard)
            load(layer, "bias", b, shard)
        q, k, v = layer(x).split([layer.num_heads * D, layer.num_kv_heads * D, layer.num_kv_heads * D], -1)
        heads = range(r * Hq // tp, (r + 1) * Hq // tp)
        # the KV head of this rank's query heads in the unsharded model (GQA: query head h uses h // (Hq/Hkv))
        kv_heads = sorted({h // (Hq // Hkv) for h in heads})
        tol = 2 * K * EPS * (x.abs().sum(-1).max() * max(wq.abs().max(), wk.abs().max(), wv.abs().max()) + 10)
        assert (q.view(6, -1, D) - q_full[:, list(heads)]).abs().max() <= tol
        assert (k.view(6, -1, D) - k_full[:, kv_heads]).abs().max() <= tol
        assert (v.view(6, -1, D) - v_full[:, kv_heads]).abs().max() <= tol


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("reduce_results", [True, False])  # False: the caller reduces (MoE shared experts)
def test_row_parallel_sum_is_the_full_layer_with_bias_once(tp, input_is_parallel, reduce_results, seed):
    torch.manual_seed(seed)
    N, K = 12, 32
    w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(9, K)
    full = x @ w.T + b
    total = torch.zeros_like(full)
    for r, layer in enumerate(ranks(tp, lambda: RowParallelLinear(K, N, bias=True, input_is_parallel=input_is_parallel,
                                                                  reduce_results=reduce_results))):
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert layer.weight.shape == (N, K // tp)
        x_r = x.chunk(tp, -1)[r] if input_is_parallel else x  # [T, K/tp] or the whole x
        total += layer(x_r)  # a partial sum: the all-reduce of a simulated rank is the caller's
    # the bias once: a bias on every rank would be off by (tp - 1) * b, far outside the bound
    assert ((total - full).abs() <= bound(x, w) + EPS * b.abs()).all()


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_parallel_embedding_sums_to_the_table(tp, seed):
    torch.manual_seed(seed)
    V, H = 37, 8  # 37 splits into ceil(37 / tp) rows per rank, the last one short (the overhang)
    table = torch.randn(V, H)
    ids = torch.randint(0, V, (50,))
    ids[:3] = torch.tensor([0, V - 1, V // 2])  # both ends of the vocabulary and a shard boundary's region
    total = torch.zeros(len(ids), H)
    per_rank = -(-V // tp)
    for r, layer in enumerate(ranks(tp, lambda: VocabParallelEmbedding(V, H))):
        load(layer, "weight", table)
        assert layer.weight.shape == (per_rank, H)
        real = min(per_rank, V - r * per_rank)
        assert (layer.weight[real:] == 0).all()  # the overhang is zeros, not what torch.empty left
        total += layer(ids)  # zeros for the ids outside this rank's rows
    assert torch.equal(total, table[ids])  # one nonzero term per element: exact


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_concat_with_overhang_is_the_full_logits(tp, tied, seed):
    torch.manual_seed(seed)
    V, H = 37, 8
    table, hidden = torch.randn(V, H), torch.randn(5, H)
    parts = []
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            head = ParallelLMHead(V, H)
            if tied:
                embed = VocabParallelEmbedding(V, H)
                load(embed, "weight", table)
                head.tie_weights(embed)
            else:
                load(head, "weight", table)
            parts.append(head.compute_logits(hidden))  # [N, ceil(V/tp)]: this rank's columns
    logits = torch.cat(parts, -1)
    assert logits.shape[1] == tp * -(-V // tp)  # the overhang columns, which the real gather cuts off
    assert ((logits[:, :V] - hidden @ table.T).abs() <= bound(hidden, table)).all()


def test_lm_head_one_rank_is_the_plain_product(seed):
    torch.manual_seed(seed)
    head = ParallelLMHead(37, 8)
    table, hidden = torch.randn(37, 8), torch.randn(3, 8)
    load(head, "weight", table)
    assert get_tensor_model_parallel_world_size() == 1
    assert torch.allclose(head.compute_logits(hidden), hidden @ table.T)


# ---- what cannot be sharded says so when the layer is built -----------------------------------


def _raises(tp: int, build, *words: str):
    with simulate_tensor_parallel(0, tp), pytest.raises(ValueError) as e:
        build()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_refusals_name_the_field_and_the_sizes_that_do():
    _raises(2, lambda: QKVParallelLinear(576, 64, 9, 3, prefix="attn.qkv_proj"), "9 query heads",
            "attn.qkv_proj", "sizes up to 16 that do: 1, 3, 9")
    _raises(4, lambda: QKVParallelLinear(64, 4, 12, 3), "neither a divisor nor a multiple of the 3 KV heads")
    _raises(4, lambda: QKVParallelLinear(64, 4, 12, 6), "does not divide the 6 KV heads")
    _raises(2, lambda: RowParallelLinear(7, 4, prefix="mlp.down_proj"), "7 input features of mlp.down_proj")
    _raises(2, lambda: MergedColumnParallelLinear(8, [5, 5], prefix="mlp.gate_up_proj"),
            "5 output features of mlp.gate_up_proj")


def test_int4_group_must_divide_each_ranks_inputs():
    q = get_quantization_config({"method": "int4", "group_size": 128})
    with simulate_tensor_parallel(1, 2):
        RowParallelLinear(512, 16, quant_config=q)  # 256 inputs per rank: two groups each
    _raises(4, lambda: RowParallelLinear(256, 16, quant_config=q, prefix="down"), "group_size 128", "64 input")


def test_gguf_mla_and_moe_refuse_tp():
    _raises(2, lambda: ColumnParallelLinear(64, 64, quant_config=GGUFConfig({"proj": "Q4_1"}), prefix="proj"),
            "gguf")
    # routed experts split at TP (tests/test_tp_moe.py); a size that does not divide them is refused
    _raises(4, lambda: FusedMoE(4, 16, 6, prefix="mlp.experts"), "6 intermediate features", "mlp.experts",
            "sizes up to 16 that do: 1, 2, 3, 6")


def test_tensor_parallel_sizes_of_the_embedded_model_shape():
    smollm2 = SimpleNamespace(name="SmolLM2", num_heads=9, num_kv_heads=3, intermediate_size=1536, moe=None, mla=None)
    assert tensor_parallel_sizes(smollm2) == [1, 3]  # 9 heads split at 3 and 9; FFN 1536 not at 9
    check_tensor_parallel_size(smollm2, 3)
    with pytest.raises(ValueError, match="sizes that do: 1, 3"):
        check_tensor_parallel_size(smollm2, 2)
    qwen3 = SimpleNamespace(num_heads=16, num_kv_heads=8, intermediate_size=3072, moe=None, mla=None)
    assert tensor_parallel_sizes(qwen3) == [1, 2, 4, 8, 16]  # 16 replicates each of the 8 KV heads twice
    with pytest.raises(ValueError, match="integer >= 1"):
        check_tensor_parallel_size(qwen3, 0)


def test_simulation_refuses_a_bad_rank_and_restores_one_rank():
    with pytest.raises(ValueError, match="rank must be in"):
        with simulate_tensor_parallel(2, 2):
            pass
    with simulate_tensor_parallel(1, 2):
        assert get_tensor_model_parallel_world_size() == 2
    assert get_tensor_model_parallel_world_size() == 1
