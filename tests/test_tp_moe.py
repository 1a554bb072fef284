"""Chapter 11's oracle for routed experts under tensor parallelism, in one process: each rank of
simulate_tensor_parallel holds every expert cut to I/tp intermediate features, loaded from the one
full checkpoint through the experts' weight loaders, and the ranks' outputs (partial sums) add up to
the unsharded layer's on fresh random inputs. The MoE block (router, routed and shared experts)
all-reduces once. Whole models at TP = 2 against TP = 1 are tests/test_tp_model.py's CASES.

Tolerance: the gate and up products of a rank are the full layer's dot products over H (a GEMM of
another shape may order them differently: H eps of their magnitude each); SiLU passes an error on
at most 1.1 times; the down product's sum over I splits into tp partial sums, and the sums over the
top-k experts and over the ranks come in another order: (I + k + tp) eps of the magnitude of the
summed terms. `bound` adds these up per output element, twice over (both sides err)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny

from minillm import LLM
from minillm.config import ModelConfig, MoEConfig
from minillm.distributed import (
    check_tensor_parallel_size,
    model_parallel_is_initialized,
    simulate_tensor_parallel,
    tensor_parallel_sizes,
)
from minillm.distributed.parallel_state import SimulatedGroup
from minillm.layers.backend import kernel_mode
from minillm.layers.moe import FusedMoE, SparseMoeBlock, expert_params_mapping, select_experts
from minillm.models.deepseek_v2 import make_shared_experts
from minillm.models.utils import load_weights

EPS = torch.finfo(torch.float32).eps
E, H, T = 6, 16, 23


def _mlp_error(x, w1, w3, down, n_terms: int) -> torch.Tensor:
    """[T, H]: how far down (silu(x w1^T) * x w3^T) may move, per token's own weights w1, w3 [T, I, H]
    and down [T, H, I], when its gate and up dots (H terms) and the sums after them (n_terms terms
    in all) are ordered differently."""
    g, u = torch.einsum("th,tih->ti", x, w1), torch.einsum("th,tih->ti", x, w3)  # [T, I]
    dg = H * EPS * torch.einsum("th,tih->ti", x.abs(), w1.abs())
    du = H * EPS * torch.einsum("th,tih->ti", x.abs(), w3.abs())
    dact = 1.1 * u.abs() * dg + (g.abs() + dg) * du  # |silu'| <= 1.1, |silu(g)| <= |g|
    act = (F.silu(g) * u).abs() + dact
    return torch.einsum("ti,thi->th", n_terms * EPS * act + dact, down.abs())


def bound(x, w13, w2, weights, ids, tp: int, extra_terms: int = 0) -> torch.Tensor:
    """Per output element [T, H]: how far two fp32 evaluations of the routed experts may differ when
    the sums are cut and ordered differently (the module docstring's terms), both sides erring."""
    I, k = w2.shape[2], ids.shape[1]
    out = torch.zeros(x.shape[0], w2.shape[1])
    for j in range(k):
        e = ids[:, j].long()
        err = _mlp_error(x, w13[e, :I], w13[e, I:], w2[e], I + k + tp + extra_terms)
        out += weights[:, j, None].abs() * err
    return 2 * out + 1e-30


def _checkpoint(g: torch.Generator, I: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """Per-expert tensors as a Hugging Face checkpoint stores them, random, not small."""
    return {f"experts.{e}.{n}.weight": torch.randn((H, I) if n == names[2] else (I, H), generator=g) * 0.5
            for e in range(E) for n in names}


def _load_experts(layer: FusedMoE, ckpt: dict) -> None:
    for param_name, ckpt_name, shard in expert_params_mapping(E):
        param = getattr(layer, param_name.split(".")[-1]).weight
        param.weight_loader(param, ckpt[f"{ckpt_name}.weight"], shard)


def _route(g: torch.Generator, top_k: int):
    x = torch.randn(T, H, generator=g)
    moe = MoEConfig(num_experts=E, num_experts_per_tok=top_k, moe_intermediate_size=8)
    weights, ids = select_experts(torch.randn(T, E, generator=g), moe)
    return x, weights, ids


@pytest.mark.parametrize("tp, I", [(2, 24), (3, 24), (4, 8)])
@torch.inference_mode()
def test_rank_partial_sums_add_up_to_the_unsharded_experts(tp, I, seed):
    g = torch.Generator().manual_seed(seed)
    ckpt = _checkpoint(g, I)
    full = FusedMoE(E, H, I)
    _load_experts(full, ckpt)
    x, weights, ids = _route(g, top_k=2)
    want = full(x, weights, ids)  # [T, H]
    total = torch.zeros_like(want)
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            layer = FusedMoE(E, H, I)
        _load_experts(layer, ckpt)
        assert layer.w13.weight.shape == (E, 2 * I // tp, H) and layer.w2.weight.shape == (E, H, I // tp)
        # rank r's slice of each expert: rows [r I/tp, (r+1) I/tp) of gate and of up, those columns of down
        rows = slice(r * I // tp, (r + 1) * I // tp)
        assert torch.equal(layer.w13.weight[:, :I // tp], full.w13.weight[:, :I][:, rows])
        assert torch.equal(layer.w13.weight[:, I // tp:], full.w13.weight[:, I:][:, rows])
        assert torch.equal(layer.w2.weight, full.w2.weight[:, :, rows])
        total += layer(x, weights, ids)  # this rank's partial sum
    err = (total - want).abs()
    tol = bound(x, full.w13.weight, full.w2.weight, weights, ids, tp)
    assert (err <= tol).all(), (err.max().item(), tol.min().item())
    assert want.abs().max() > 1e3 * tol.max()  # the bound is tight enough to catch a lost or doubled slice


@torch.inference_mode()
def test_rank_slices_on_the_fused_kernel(seed):
    """The Triton kernel (the interpreter on a CPU) on a rank's [E, 2I/tp, H] and [E, H, I/tp]
    slices: the ranks' sum is the unsharded layer's."""
    g = torch.Generator().manual_seed(seed)
    I, tp = 24, 2
    ckpt = _checkpoint(g, I)
    full = FusedMoE(E, H, I)
    _load_experts(full, ckpt)
    x, weights, ids = _route(g, top_k=2)
    want = full(x, weights, ids)  # the per-expert loop, on the CPU
    tol = bound(x, full.w13.weight, full.w2.weight, weights, ids, tp)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    total = torch.zeros_like(want)
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            layer = FusedMoE(E, H, I)
        _load_experts(layer, ckpt)
        with kernel_mode("triton"):
            total += layer.to(dev)(x.to(dev), weights.to(dev), ids.to(dev)).cpu()
    assert ((total - want).abs() <= tol).all(), (total - want).abs().max().item()


@pytest.mark.parametrize("tp", [2, 4])
@torch.inference_mode()
def test_stacked_checkpoint_gives_each_rank_the_same_slice(tp, seed):
    """A checkpoint that stacks the experts (w13 [E, 2I, H], w2 [E, H, I]) lands as the per-expert one."""
    g = torch.Generator().manual_seed(seed)
    I = 8
    ckpt = _checkpoint(g, I)
    w13 = torch.stack([torch.cat([ckpt[f"experts.{e}.gate_proj.weight"], ckpt[f"experts.{e}.up_proj.weight"]])
                       for e in range(E)])  # [E, 2I, H]
    w2 = torch.stack([ckpt[f"experts.{e}.down_proj.weight"] for e in range(E)])  # [E, H, I]
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            per_expert, stacked = FusedMoE(E, H, I), FusedMoE(E, H, I)
        _load_experts(per_expert, ckpt)
        stacked.w13.weight.weight_loader(stacked.w13.weight, w13)
        stacked.w2.weight.weight_loader(stacked.w2.weight, w2)
        assert torch.equal(stacked.w13.weight, per_expert.w13.weight)
        assert torch.equal(stacked.w2.weight, per_expert.w2.weight)


def _moe_config(I: int, shared: int, topk_method: str = "greedy") -> ModelConfig:
    moe = MoEConfig(num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I, num_shared_experts=shared,
                    topk_method=topk_method, **(dict(n_group=3, topk_group=2) if topk_method != "greedy" else {}))
    return ModelConfig(architecture="deepseek_v2", vocab_size=16, hidden_size=H, intermediate_size=2 * I,
                       num_layers=1, num_heads=4, num_kv_heads=4, head_dim=4, max_position_embeddings=32, moe=moe)


class _Holder(torch.nn.Module):
    """One MoE block under `mlp.`, with the shared experts a model file builds (models/deepseek_v2.py)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        shared = make_shared_experts(config, None, "mlp")
        self.mlp = SparseMoeBlock(config, prefix="mlp", shared_experts=shared)


@pytest.mark.parametrize("tp, shared", [(2, 1), (2, 0), (4, 2)])
@torch.inference_mode()
def test_block_with_shared_experts_all_reduces_once(tp, shared, seed, monkeypatch):
    """Router replicated (every rank picks the same experts), routed + shared experts partial sums,
    one all-reduce per block: the ranks' outputs add up to the unsharded block's."""
    g = torch.Generator().manual_seed(seed)
    I = 8
    config = _moe_config(I, shared, "group_limited_greedy")
    ckpt = {f"mlp.{k}": v for k, v in _checkpoint(g, I).items()} | {"mlp.gate.weight": torch.randn(E, H, generator=g)}
    if shared:
        S = I * shared
        ckpt |= {"mlp.shared_experts.gate_proj.weight": torch.randn(S, H, generator=g) * 0.5,
                 "mlp.shared_experts.up_proj.weight": torch.randn(S, H, generator=g) * 0.5,
                 "mlp.shared_experts.down_proj.weight": torch.randn(H, S, generator=g) * 0.5}
    mapping = [*expert_params_mapping(E, "experts", "experts"), ("gate_up_proj", "gate_proj", 0),
               ("gate_up_proj", "up_proj", 1)]
    full = _Holder(config)
    load_weights(full, ckpt.items(), mapping)  # every parameter (each shard) filled exactly once
    x = torch.randn(T, H, generator=g)
    want = full.mlp(x)

    reduces = []
    real = SimulatedGroup.all_reduce
    monkeypatch.setattr(SimulatedGroup, "all_reduce", lambda self, t: reduces.append(t.shape) or real(self, t))
    total = torch.zeros_like(want)
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            rank = _Holder(config)
            load_weights(rank, ckpt.items(), mapping)
            assert rank.mlp.gate.weight.shape == (E, H)  # the router whole on every rank
            total += rank.mlp(x)
    assert reduces == [(T, H)] * tp  # one all-reduce per block on each rank: none in the shared experts
    # the shared experts: one more MLP, its down sum over S = I * shared cut in tp, added to the routed sum
    logits = x @ ckpt["mlp.gate.weight"].T
    weights, ids = select_experts(logits, config.moe)
    tol = bound(x, full.mlp.experts.w13.weight, full.mlp.experts.w2.weight, weights, ids, tp, extra_terms=1)
    if shared:
        S = I * shared
        gu, down = full.mlp.shared_experts.gate_up_proj.weight, full.mlp.shared_experts.down_proj.weight
        per_token = [w.expand(T, *w.shape) for w in (gu[:S], gu[S:], down)]  # [T, S, H], [T, S, H], [T, H, S]
        tol = tol + 2 * _mlp_error(x, *per_token, S + 3 + tp + 1)
    assert ((total - want).abs() <= tol).all(), (total - want).abs().max().item()


def test_shared_experts_come_from_the_model_file():
    config = _moe_config(8, shared=1)
    with pytest.raises(ValueError, match="num_shared_experts is 1 but shared_experts is None"):
        SparseMoeBlock(config, prefix="model.layers.1.mlp")


def test_a_size_that_does_not_divide_the_experts_is_refused():
    config = _moe_config(6, shared=0)  # heads 4, FFN 12: 2 splits everything, 4 not the experts' 6
    with simulate_tensor_parallel(0, 4), pytest.raises(ValueError) as e:
        SparseMoeBlock(config, prefix="model.layers.1.mlp")
    assert "6 intermediate features of each routed expert of model.layers.1.mlp.experts" in str(e.value)
    assert "sizes up to 16 that do: 1, 2, 3, 6" in str(e.value)
    assert tensor_parallel_sizes(config) == [1, 2]  # heads 4 and FFN 12 and experts 6 all divide
    check_tensor_parallel_size(config, 2)
    with pytest.raises(ValueError, match="routed experts of intermediate size 6.*sizes that do: 1, 2$"):
        check_tensor_parallel_size(config, 4)


@pytest.mark.slow
def test_llm_refuses_a_size_that_does_not_divide_the_experts(tmp_path):
    """Through `LLM` (spawned workers): heads (4), KV heads (2) and the dense FFN (112) split at 2, the
    experts' 33 do not; the error names them and the sizes that do, and the group is torn down."""
    folder = make_tiny("qwen3_moe", tmp_path / "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match="33 intermediate features of each routed expert of model.layers.0.mlp"
                                         r".experts; sizes up to 16 that do: 1, 3, 11"):
        LLM(str(folder), tensor_parallel_size=2, device="cpu", dtype="float32", num_gpu_blocks=8, block_size=4)
    assert not model_parallel_is_initialized()
