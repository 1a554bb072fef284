"""Fused mixture-of-experts in Triton: every expert's MLP for every routed token in two launches.

A MoE layer sends each token to top_k of E expert MLPs (silu(x W1^T) * (x W3^T)) W2^T and sums the
results weighted by the router. Run expert by expert (`fused_experts_ref`, the oracle) that is 3 E
small GEMMs, E host round trips to learn which tokens each expert got, and at decode (a few tokens,
most experts idle) nothing but launch overhead. The fused path (vLLM's fused_moe, the MegaBlocks idea):

1. `moe_align_block_size`: the T x top_k (token, expert) pairs sorted by expert, each expert's run
   padded to a multiple of BLOCK_M rows, so that a tile of BLOCK_M rows belongs to one expert:

       topk_ids [[2, 0], [2, 1]]   (T = 2, top_k = 2, pairs 0..3 = token * top_k + k)
       sorted_token_ids  [1, P, P, P | 3, P, P, P | 0, 2, P, P]   (BLOCK_M = 4, P = 4 = padding)
       expert_ids        [0,         1,             2        ]    one per tile of rows

   Everything is computed on the device from static sizes (the longest the padded list can be),
   with no host sync on the expert counts: the same launches replay in a CUDA graph.
2. One grouped GEMM launch for gate_up: program (row tile, column tile) reads its tile's expert id,
   gathers its tokens' rows of x and multiplies them by that expert's W1 and W3 tiles, and writes
   silu(gate) * up (SwiGLU fused: the [T*k, 2I] gate_up never reaches memory).
3. One grouped GEMM launch for down, the router weight of each pair applied to its row.
4. The sum over each token's top_k rows.

Padding rows (P) read nothing and write nothing; tiles past the padded end return at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, INTERPRET, check_device, check_float_tensor, check_tensor
from .flash_attn import dot


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # (BLOCK_N, BLOCK_K, warps, stages): vLLM-like starting points; the autotuner picks per shape
    shapes = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]  # few: each compiles per shape
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in shapes]


def _prune(configs, named_args, **kwargs):
    """fp32 (IEEE dots, for exactness checks) compiles slowly in wide tiles: keep the smallest."""
    if named_args["A"].dtype != torch.float32:
        return configs
    return [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


@triton.autotune(configs=_configs(), key=["N", "K", "TOP_K", "GATED", "BLOCK_M"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fused_moe_kernel(
    A, B, C, TopkWeights,  # a [rows, K]; b [E, N or 2N, K]; c [T * top_k, N]; weights [T * top_k] fp32
    sorted_token_ids, expert_ids, num_tokens_post_padded,  # int32 [max_padded], [max_blocks], [1]
    N, K, num_valid,  # num_valid = T * top_k: a sorted id >= this is padding
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr,  # rows of a per token: pair p reads row p // TOP_K (1: a holds one row per pair)
    GATED: tl.constexpr,  # b holds [W1; W3]: write silu(a W1^T) * (a W3^T)
    MUL_ROUTED_WEIGHT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # chosen by the autotuner
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded):
        return  # past the padded end: this step routed fewer pairs than the worst case
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids + offs_m)  # [BLOCK_M] (token, k) pair ids of this tile's rows
    valid = pair < num_valid
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_ok = offs_n < N
    a_rows = A + (pair // TOP_K).to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    b_cols = B + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn  # [1, BLOCK_N]: W^T's columns
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_cols + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = dot(a, b, acc, IEEE)
        if GATED:  # the up projection's rows sit N rows below the gate's in the stacked weight
            b_up = tl.load(b_cols + N * stride_bn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_up = dot(a, b_up, acc_up, IEEE)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in fp32
    if MUL_ROUTED_WEIGHT:
        w = tl.load(TopkWeights + pair, mask=valid, other=0.0)  # [BLOCK_M]
        acc = acc * w[:, None]
    c = C + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """(token, expert) pairs sorted by expert, each expert's run padded to a multiple of block_m.

    topk_ids [T, top_k] -> sorted_token_ids [max_padded] int32 (pair ids; T * top_k marks padding),
    expert_ids [max_padded / block_m] int32 (the expert of each tile; past the end: num_experts),
    num_tokens_post_padded [1] int32. Sizes depend on T, top_k, E and block_m only (no host sync)."""
    T, top_k = topk_ids.shape
    n, dev = T * top_k, topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [n]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E] rows each expert takes
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # [n] pairs grouped by expert, in token order within one
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]  # index within its expert
    # at most min(n, E) experts are non-empty, each wasting fewer than block_m rows
    max_padded = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, tile_start, right=True).to(torch.int32)  # [max_padded / block_m]
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _check(x, w13, w2, topk_weights, topk_ids, strict: bool) -> None:
    check_float_tensor("x", x, FLOAT_DTYPES if strict else None, dims=2, layout="[tokens, hidden]")
    check_float_tensor("w13", w13, FLOAT_DTYPES if strict else None, dims=3, layout="[experts, 2 * inter, hidden]")
    check_float_tensor("w2", w2, FLOAT_DTYPES if strict else None, dims=3, layout="[experts, hidden, inter]")
    E, two_i, H = w13.shape
    if two_i % 2 or H != x.shape[1] or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"expert weights must be w13 [E, 2I, H] and w2 [E, H, I] with H = x's {x.shape[1]}, got "
                         f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    check_tensor("topk_ids", topk_ids)
    check_tensor("topk_weights", topk_weights)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [tokens={x.shape[0]}, top_k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_ids.shape[1] > E:
        raise ValueError(f"top_k ({topk_ids.shape[1]}) must be <= the number of experts ({E})")
    if strict:
        check_device("x", x)


def _block_m(num_pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows per tile, from the pairs an expert gets on average: at decode a few, so short tiles (each
    expert's run is padded to a whole tile); in a long prefill hundreds, so tall ones. Decided from
    shapes, so one CUDA graph always runs the same tiles."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 256 else 128
    return min(block_m, 32) if INTERPRET or dtype == torch.float32 else block_m


def fused_experts(x, w13, w2, topk_weights, topk_ids):
    """sum_k topk_weights[t, k] * MLP_{topk_ids[t, k]}(x[t]) for every token: x [T, H] -> [T, H].

    w13 [E, 2I, H]: each expert's gate (rows 0..I) and up (rows I..2I) projections; w2 [E, H, I]."""
    _check(x, w13, w2, topk_weights, topk_ids, strict=True)
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if T == 0:
        return torch.empty_like(x)
    block_m = _block_m(T * top_k, E, x.dtype)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, E)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()  # [T * top_k], pair order
    inter = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    down = torch.empty((T * top_k, H), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    tiles = sorted_ids.numel() // block_m
    _fused_moe_kernel[lambda meta: (tiles, triton.cdiv(I, meta["BLOCK_N"]))](
        x, w13, inter, weights, sorted_ids, expert_ids, num_post, I, H, T * top_k,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=top_k, GATED=True, MUL_ROUTED_WEIGHT=False, IEEE=ieee, BLOCK_M=block_m)
    _fused_moe_kernel[lambda meta: (tiles, triton.cdiv(H, meta["BLOCK_N"]))](
        inter, w2, down, weights, sorted_ids, expert_ids, num_post, H, I, T * top_k,
        inter.stride(0), w2.stride(0), w2.stride(1), down.stride(0),
        TOP_K=1, GATED=False, MUL_ROUTED_WEIGHT=True, IEEE=ieee, BLOCK_M=block_m)
    return down.view(T, top_k, H).sum(dim=1)  # [T, H]


def fused_experts_ref(x, w13, w2, topk_weights, topk_ids):
    """The oracle: expert by expert, each over the tokens routed to it (DeepSeek-V3's reference
    model and Hugging Face's do the same). Computes in x's dtype, accumulates in fp32."""
    _check(x, w13, w2, topk_weights, topk_ids, strict=False)
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)  # the tokens routed to expert e, and which of their top_k it is
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ w13[e].t()  # [n, 2I]
        y = (F.silu(gate_up[:, :I]) * gate_up[:, I:]) @ w2[e].t()  # [n, H]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
