"""Mixture of experts: a router picks top_k of E expert MLPs per token; only those run.

    x [T, H] --gate--> router logits [T, E] --select_experts--> topk_weights, topk_ids [T, k]
             --experts (FusedMoE)--> sum_k weight * MLP_id(x) [T, H]  (+ shared experts, every token)

The routers of the families differ in four switches (vLLM's names):
    scoring_func     softmax over the E logits (Mixtral, Qwen, DeepSeek-V2) or a sigmoid each (V3)
    renormalize      divide the top_k weights by their sum (Mixtral, Qwen3 norm_topk_prob, V3)
    grouped top-k    DeepSeek: the experts form n_group groups; only the topk_group best groups may
                     be picked from (V2 "group_limited_greedy": a group's score is its best expert;
                     V3 "noaux_tc": the sum of its best two, with a learnt e_score_correction_bias
                     added for choosing only, the weights stay the raw scores)
    routed_scaling_factor   a constant multiplying the routed weights (V3: 2.5)

FusedMoE holds all experts' weights stacked, w13 [E, 2I, H] (each expert's gate_proj rows above
its up_proj rows) and w2 [E, H, I], so one Triton launch reaches any expert (kernels/fused_moe.py).
Checkpoints store one tensor per expert and projection; `expert_params_mapping` tells the generic
loader (models/utils.py) where each goes, and a missing or extra expert tensor is an error there.

Tensor parallelism (chapter 11) splits each expert's intermediate size, as a Llama MLP's: every rank
holds all E experts at I/tp features (w13 [E, 2I/tp, H], w2 [E, H, I/tp]), routes identically (the
router is replicated), and gives a partial sum; one all-reduce after routed + shared experts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig, MoEConfig
from ..distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from ..kernels import fused_moe as _kernel
from .backend import use_triton
from .linear import ReplicatedLinear, ShapeMismatch, copy_checked


def fused_topk(scores: torch.Tensor, top_k: int, renormalize: bool):
    """The top_k experts by score [T, E] -> (weights fp32 [T, k], ids int32 [T, k])."""
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, ids.to(torch.int32)


def grouped_topk(scores: torch.Tensor, top_k: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 e_score_correction_bias: torch.Tensor | None = None):
    """DeepSeek's group-limited routing: keep the topk_group best of num_expert_group groups, pick the
    top_k experts inside them. With a correction bias (V3) the choice uses score + bias, a group's
    score is the sum of its best two and the weights are the unbiased scores; without (V2) a group's
    score is its best expert's."""
    T, E = scores.shape
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = choice.view(T, num_expert_group, E // num_expert_group)  # [T, groups, E / groups]
    if e_score_correction_bias is None:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)  # [T, groups]
    keep = keep[:, :, None].expand_as(grouped).reshape(T, E)
    # V2 masks dropped experts to 0 (its scores are positive), V3 to -inf (score + bias may be negative)
    choice = choice.masked_fill(~keep, 0.0 if e_score_correction_bias is None else float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, ids.to(torch.int32)


def select_experts(router_logits: torch.Tensor, moe: MoEConfig, e_score_correction_bias: torch.Tensor | None = None):
    """router logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]), as `moe` says."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if moe.scoring_func == "softmax" else logits.sigmoid()
    if moe.topk_method == "greedy":
        weights, ids = fused_topk(scores, moe.num_experts_per_tok, moe.norm_topk_prob)
    else:
        bias = e_score_correction_bias if moe.topk_method == "noaux_tc" else None
        weights, ids = grouped_topk(scores, moe.num_experts_per_tok, moe.norm_topk_prob, moe.n_group, moe.topk_group,
                                    bias)
    return weights * moe.routed_scaling_factor, ids


class ExpertShard(tuple):
    """Which checkpoint tensor fills part of a stacked expert weight: (expert, 'w1'|'w3'|'w2'). Its
    str is the checkpoint's own name, so the loader's "missing" error names the tensor."""

    def __new__(cls, expert: int, which: str, ckpt_name: str):
        self = super().__new__(cls, (expert, which))
        self.ckpt_name = ckpt_name
        return self

    def __str__(self) -> str:
        return self.ckpt_name


class ExpertWeight(nn.Module):
    """One stacked weight of all experts, this rank's slice [E, out, in], and the loader of its
    per-expert parts. Under tensor parallelism each expert's intermediate size I splits across ranks
    (vLLM's way): rank r holds rows [r I/tp, (r+1) I/tp) of each of w1 (gate) and w3 (up), stacked
    as w13 [E, 2I/tp, H] (gate rows above up rows), and the same columns of w2 (down), [E, H, I/tp].
    `split_dim` is the dimension of one expert's [out, in] that splits (0 for w13, 1 for w2), `parts`
    the checkpoint tensors stacked along its output (2 for w13, 1 for w2)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, shard_ids: tuple, split_dim: int,
                 parts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.shard_ids, self.split_dim, self.parts = shard_ids, split_dim, parts
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def _rank_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/tp of t along dim."""
        size = t.shape[dim] // self.tp_size
        return t.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        E, out, inp = param.data.shape
        whole = [out, inp]  # one expert's [out, in] before the split
        whole[self.split_dim] *= self.tp_size
        if shard_id is None:  # a checkpoint that already stacks the experts (transformers 5 in memory)
            _check_shape(loaded_weight, (E, *whole))
            parts = loaded_weight.chunk(self.parts, dim=1)  # [E, out / parts, in] each (gate, up)
            return copy_checked(param.data, torch.cat([self._rank_slice(p, 1 + self.split_dim) for p in parts], 1))
        expert, which = shard_id
        _check_shape(loaded_weight, (whole[0] // self.parts, whole[1]))
        dst = param.data[expert].chunk(self.parts, dim=0)[{"w1": 0, "w3": 1, "w2": 0}[which]]  # w3 (up): second
        copy_checked(dst, self._rank_slice(loaded_weight, self.split_dim))


def _check_shape(t: torch.Tensor, want: tuple) -> None:
    """The whole checkpoint tensor's shape, before this rank takes its slice of it."""
    if tuple(t.shape) != tuple(want):
        raise ShapeMismatch(tuple(t.shape), tuple(want))


class FusedMoE(nn.Module):
    """All experts of one layer: (x [T, H], topk_weights, topk_ids [T, k]) -> [T, H].

    Under tensor parallelism every rank holds all experts, each cut to I/tp of its intermediate
    features (ExpertWeight), and runs the same routing; its output is then a partial sum over its
    intermediate features, and the ranks' outputs sum to the unsplit layer's. The caller (the MoE
    block) all-reduces once, after adding the shared experts' partial sums."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ckpt_prefix: str = "experts",
                 ckpt_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), prefix: str = ""):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        name = prefix or ckpt_prefix
        I = divide(intermediate_size, self.tp_size, f"the {intermediate_size} intermediate features of each routed "
                                                     f"expert of {name}")
        self.intermediate_size_per_partition = I

        def shards(which: tuple[str, ...]):
            return tuple(ExpertShard(e, w, f"{ckpt_prefix}.{e}.{ckpt_names[('w1', 'w3', 'w2').index(w)]}")
                         for e in range(num_experts) for w in which)

        self.w13 = ExpertWeight(num_experts, 2 * I, hidden_size, shards(("w1", "w3")), split_dim=0, parts=2)
        self.w2 = ExpertWeight(num_experts, hidden_size, I, shards(("w2",)), split_dim=1, parts=1)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        experts = _kernel.fused_experts if use_triton(x) else _kernel.fused_experts_ref
        return experts(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids)  # [T, H], this rank's part


def expert_params_mapping(num_experts: int, ckpt_prefix: str = "experts", param_prefix: str = "experts",
                          ckpt_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list:
    """(our parameter, checkpoint name, shard) rows for models/utils.load_weights, one per expert and
    projection: `{ckpt_prefix}.{e}.gate_proj` -> `{param_prefix}.w13` shard (e, 'w1'), and so on.
    They must come before a model's own rows (".gate_proj." alone would match an expert's too)."""
    rows = []
    for e in range(num_experts):
        for name, which, target in zip(ckpt_names, ("w1", "w3", "w2"), ("w13", "w13", "w2")):
            ckpt = f"{ckpt_prefix}.{e}.{name}"
            rows.append((f"{param_prefix}.{target}", ckpt, ExpertShard(e, which, ckpt)))
    return rows


class MoEGate(ReplicatedLinear):
    """The router: logits = x W^T over the E experts, and V3's e_score_correction_bias beside it."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, prefix: str = ""):
        super().__init__(hidden_size, num_experts, bias=False, prefix=prefix)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)


class SparseMoeBlock(nn.Module):
    """A MoE MLP: router, routed experts, and (DeepSeek) shared experts that every token runs.

    The shared experts are the model file's (an MLP whose down projection does not all-reduce): under
    tensor parallelism both the routed and the shared experts give partial sums, and the block
    all-reduces their sum once. The router is replicated, so every rank picks the same experts.
    `quant_config` reaches none of the block's own weights (router and routed experts stay unquantized);
    the model file passes it to the shared experts it builds."""

    def __init__(self, config: ModelConfig, quant_config=None, prefix: str = "", ckpt_prefix: str = "experts",
                 ckpt_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 shared_experts: nn.Module | None = None):
        super().__init__()
        moe = config.moe
        self.moe = moe
        if bool(moe.num_shared_experts) != (shared_experts is not None):
            raise ValueError(f"{prefix or 'SparseMoeBlock'}: config moe.num_shared_experts is "
                             f"{moe.num_shared_experts} but shared_experts is "
                             f"{'given' if shared_experts is not None else 'None'} (the model file builds them)")
        self.tp_size = get_tensor_model_parallel_world_size()
        self.gate = MoEGate(config.hidden_size, moe.num_experts, moe.topk_method == "noaux_tc", f"{prefix}.gate")
        self.experts = FusedMoE(moe.num_experts, config.hidden_size, moe.moe_intermediate_size, ckpt_prefix,
                                ckpt_names, prefix=f"{prefix}.experts")
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E], fp32 as HF's routers
        topk_weights, topk_ids = select_experts(logits, self.moe, self.gate.e_score_correction_bias)
        out = self.experts(x, topk_weights, topk_ids)  # [T, H]: a partial sum under TP
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # [T, H]: a partial sum too (no all-reduce of its own)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
