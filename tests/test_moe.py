"""The MoE layer (layers/moe.py): each family's router gives transformers' router's experts and
weights, the routed experts equal a dense oracle (every expert on every token, weighted by a
[T, E] routing matrix that is zero off the top-k), the kernel path equals the loop inside the
layer, per-expert checkpoint tensors land in the right rows of the stacked weights, and bad MoE
configs are clear errors.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from minillm.config import ModelConfig, MoEConfig
from minillm.layers.backend import kernel_mode
from minillm.layers.moe import FusedMoE, SparseMoeBlock, expert_params_mapping, select_experts
from minillm.models.utils import load_weights

E, H, T = 8, 32, 40


def _hf_router(family: str, top_k: int, **cfg):
    """transformers' own router module for a family, with random weights (and V3's bias)."""
    base = dict(hidden_size=H, num_experts_per_tok=top_k, num_attention_heads=4)
    modules = {"mixtral": ("mixtral", "MixtralTopKRouter", "MixtralConfig", dict(num_local_experts=E)),
               "qwen3_moe": ("qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeConfig", dict(num_experts=E)),
               "deepseek_v2": ("deepseek_v2", "DeepseekV2TopkRouter", "DeepseekV2Config", dict(n_routed_experts=E)),
               "deepseek_v3": ("deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3Config", dict(n_routed_experts=E))}
    module, router_name, config_name, experts = modules[family]
    Router = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), router_name, None)
    if Router is None:  # the model-level parity (test_models_moe.py) still holds the router to HF's
        pytest.skip(f"transformers {transformers.__version__} has no {router_name} module to compare with")
    config = getattr(transformers, config_name)(**base, **experts, **cfg)
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.3)
    return router


CASES = [  # (family, top_k, transformers config, our MoEConfig fields)
    ("mixtral", 2, {}, {}),
    ("qwen3_moe", 3, dict(norm_topk_prob=False), dict(norm_topk_prob=False)),
    ("qwen3_moe", 3, dict(norm_topk_prob=True), {}),
    ("deepseek_v2", 3, dict(topk_method="greedy", routed_scaling_factor=1.5),
     dict(norm_topk_prob=False, routed_scaling_factor=1.5)),
    ("deepseek_v2", 3, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     dict(norm_topk_prob=False, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("deepseek_v3", 4, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5),
     dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
]


def _by_expert(weights, ids):
    """[T, k] weights and ids in expert order (routers may return the top-k unsorted)."""
    order = ids.long().argsort(-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("family,top_k,hf_cfg,ours", CASES)
@torch.inference_mode()
def test_router_matches_transformers(seed, family, top_k, hf_cfg, ours):
    torch.manual_seed(seed)
    router = _hf_router(family, top_k, **hf_cfg)
    x = torch.randn(T, H)
    logits, hf_weights, hf_ids = router(x)
    moe = MoEConfig(num_experts=E, num_experts_per_tok=top_k, moe_intermediate_size=16, **ours)
    weights, ids = select_experts(logits, moe, getattr(router, "e_score_correction_bias", None))
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    w1, i1 = _by_expert(weights, ids)
    w2, i2 = _by_expert(hf_weights.float(), hf_ids)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2)


def test_grouped_routing_picks_only_inside_the_best_groups(seed):
    """V2's group-limited top-k: every chosen expert lies in one of the topk_group groups whose best
    expert scores highest."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 16, generator=g)
    moe = MoEConfig(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=8, topk_method="group_limited_greedy",
                    n_group=4, topk_group=2, norm_topk_prob=False)
    _, ids = select_experts(logits, moe)
    best_groups = logits.softmax(-1).view(T, 4, 4).amax(-1).topk(2, dim=-1).indices  # [T, 2]
    assert ((ids.long()[:, :, None] // 4) == best_groups[:, None, :]).any(-1).all()


def _dense_oracle(x, w13, w2, weights, ids):
    """Every expert on every token, weighted by a [T, E] matrix that is zero off each token's top-k."""
    route = torch.zeros(x.shape[0], w13.shape[0]).scatter_(1, ids.long(), weights)  # [T, E]
    I = w2.shape[2]
    gate_up = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
    y = torch.einsum("tei,ehi->teh", F.silu(gate_up[..., :I]) * gate_up[..., I:], w2)  # [T, E, H]
    return (route[:, :, None] * y).sum(1)


@torch.inference_mode()
def test_experts_equal_the_dense_oracle_on_both_paths(seed):
    g = torch.Generator().manual_seed(seed)
    experts = FusedMoE(E, H, 24)
    experts.w13.weight.copy_(torch.randn(E, 48, H, generator=g) * 0.2)
    experts.w2.weight.copy_(torch.randn(E, H, 24, generator=g) * 0.2)
    x = torch.randn(T, H, generator=g)
    moe = MoEConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=24)
    weights, ids = select_experts(torch.randn(T, E, generator=g), moe)
    want = _dense_oracle(x, experts.w13.weight, experts.w2.weight, weights, ids)
    # where the kernels run: the CPU under the interpreter, else the GPU (fp32: IEEE dots)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    experts, x, weights, ids, want = experts.to(dev), x.to(dev), weights.to(dev), ids.to(dev), want.to(dev)
    with kernel_mode("torch"):
        torch.testing.assert_close(experts(x, weights, ids), want, rtol=0, atol=1e-5)
    with kernel_mode("triton"):  # the fused Triton kernel (interpreter on a CPU)
        torch.testing.assert_close(experts(x, weights, ids), want, rtol=0, atol=1e-5)


class _Holder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = SparseMoeBlock(config, prefix="mlp", ckpt_prefix="experts", ckpt_names=("w1", "w3", "w2"))


@torch.inference_mode()
def test_per_expert_tensors_land_in_their_rows(seed):
    g = torch.Generator().manual_seed(seed)
    config = ModelConfig(architecture="mixtral", vocab_size=16, hidden_size=H, intermediate_size=24, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32,
                         moe=MoEConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=24))
    holder = _Holder(config)
    ckpt = {f"mlp.experts.{e}.{w}.weight": torch.randn((H, 24) if w == "w2" else (24, H), generator=g)
            for e in range(3) for w in ("w1", "w2", "w3")} | {"mlp.gate.weight": torch.randn(3, H, generator=g)}
    load_weights(holder, ckpt.items(), expert_params_mapping(3, "experts", "experts", ("w1", "w3", "w2")))
    for e in range(3):
        assert torch.equal(holder.mlp.experts.w13.weight[e, :24], ckpt[f"mlp.experts.{e}.w1.weight"])
        assert torch.equal(holder.mlp.experts.w13.weight[e, 24:], ckpt[f"mlp.experts.{e}.w3.weight"])
        assert torch.equal(holder.mlp.experts.w2.weight[e], ckpt[f"mlp.experts.{e}.w2.weight"])
    del ckpt["mlp.experts.2.w2.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor.*mlp\.experts\.w2\.weight:experts\.2\.w2"):
        load_weights(_Holder(config), ckpt.items(), expert_params_mapping(3, "experts", "experts", ("w1", "w3", "w2")))


@pytest.mark.parametrize("fields,match", [
    (dict(num_experts_per_tok=9), r"moe\.num_experts_per_tok \(9\) must be <= num_experts \(8\)"),
    (dict(scoring_func="tanh"), r"moe\.scoring_func must be one of softmax, sigmoid, not 'tanh'"),
    (dict(topk_method="best"), r"moe\.topk_method must be one of greedy, group_limited_greedy, noaux_tc"),
    (dict(topk_method="noaux_tc", n_group=3, topk_group=1), r"n_group \(3\) must divide num_experts \(8\)"),
    (dict(topk_method="noaux_tc", n_group=4, topk_group=5), r"topk_group \(5\) must be <= n_group"),
    (dict(topk_method="noaux_tc", n_group=4, topk_group=1, num_experts_per_tok=3),
     r"num_experts_per_tok \(3\) must be <= the experts of topk_group \(1\) groups"),
    (dict(topk_method="group_limited_greedy"), r"moe\.n_group must be a positive int, not None"),
    (dict(moe_intermediate_size=0), r"moe\.moe_intermediate_size must be a positive int"),
])
def test_bad_moe_configs_are_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16) | fields))


# ---- lab 10's checks bite ---------------------------------------------------------------------------


def test_lab10_checks_pass_the_solution_and_fail_wrong_answers():
    from test_labs_engine import fails, solution

    from minillm.labs import ch10

    ns = solution("10_mla_moe")
    route, absorbed, naive = ns["route"], ns["absorbed_attention"], ns["naive_attention"]
    assert ch10.check_route(route).passed
    assert ch10.check_absorbed_attention(absorbed).passed
    assert ch10.check_absorbed_attention(naive).passed  # the identity itself: naive = minillm's absorbed

    def softmax_after_topk(logits, top_k, renormalize):  # normalises over the chosen experts only
        w, i = logits.topk(top_k, dim=-1)
        return w.softmax(-1), i

    fails(ch10.check_route, softmax_after_topk)
    fails(ch10.check_route, lambda lg, k, renorm: route(lg, k, not renorm))
    fails(ch10.check_route, lambda lg, k, renorm: route(lg, min(k + 1, lg.shape[1]), renorm))

    def no_rope(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
        return absorbed(q_nope, q_pe * 0, c, k_pe, w_uk, w_uv, scale)

    def heads_mixed_up(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):  # each head with another head's W_UK
        return absorbed(q_nope, q_pe, c, k_pe, w_uk.flip(0), w_uv, scale)

    fails(ch10.check_absorbed_attention, no_rope)
    fails(ch10.check_absorbed_attention, heads_mixed_up)
    fails(ch10.check_absorbed_attention, lambda *a: absorbed(*a[:-1], 1.0))
