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

Tiles. Which tile shape is fastest depends on how many rows each expert gets (M top_k / E): a
decode step gives each expert a row or two and only streams weights (short BLOCK_M, long BLOCK_K);
a long prefill gives hundreds and is a real GEMM (128-row tiles, 8 warps). The choice per M comes
from a table tuned on the GPU (`minillm bench moe --tune`, one JSON per experts, N = intermediate
size, GPU and dtype, in moe_configs/), else from `default_config`. The programs run in groups of
GROUP_SIZE_M row tiles that walk the column tiles together, so an expert's weight tile is read from
HBM once per group rather than once per row tile (the rest hit L2). At one or two tokens the sort is
skipped: each pair gets a tile of its own (`align_unsorted`), a few elementwise ops instead of a
sort, a scatter and a search.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, INTERPRET, check_device, check_float_tensor, check_tensor
from .flash_attn import dot

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "moe_configs")
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def default_config(M: int, E: int, top_k: int, dtype: torch.dtype) -> dict:
    """Tiles when no tuned table exists, from the rows each expert gets on average. BLOCK_K is 64 or
    more everywhere (32 halves the work per load and was the slow default other engines dropped)."""
    per_expert = M * top_k / E
    if INTERPRET or dtype == torch.float32:  # small tiles: the interpreter's speed, fp32's compile time
        return dict(BLOCK_M=16 if per_expert <= 16 else 32, BLOCK_N=32, BLOCK_K=32, GROUP_SIZE_M=2,
                    num_warps=4, num_stages=1)
    if per_expert <= 16:  # weight streaming: few rows, long K loads
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_SIZE_M=4, num_warps=4, num_stages=3)
    if per_expert <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


def config_file_name(E: int, N: int, device_name: str, dtype: torch.dtype) -> str:
    """vLLM's naming: E experts, N = each expert's intermediate size, the GPU's name, the dtype."""
    return f"E={E},N={N},device_name={device_name.replace(' ', '_')},dtype={str(dtype).removeprefix('torch.')}.json"


@functools.cache
def load_configs(E: int, N: int, device_name: str, dtype: torch.dtype) -> dict[int, dict] | None:
    """The tuned table {M: config} for these shapes on this GPU, or None if none was tuned."""
    path = os.path.join(CONFIG_DIR, config_file_name(E, N, device_name, dtype))
    if not os.path.exists(path):
        return None
    with open(path) as f:
        table = json.load(f)
    return {int(m): {k: int(cfg[k]) for k in CONFIG_KEYS} for m, cfg in table.items() if not m.startswith("_")}


def get_config(M: int, E: int, N: int, top_k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned config of the nearest tuned M (shapes only: one CUDA graph always runs the same tiles)."""
    if device.type == "cuda" and not INTERPRET:
        table = load_configs(E, N, torch.cuda.get_device_name(device), dtype)
        if table:
            return table[min(table, key=lambda m: abs(m - M))]
    return default_config(M, E, top_k, dtype)


@triton.jit(do_not_specialize=["tiles_m", "group_size_m"])  # launch-order knobs: no recompile
def _fused_moe_kernel(
    A, B, C, TopkWeights,  # a [rows, K]; b [E, N or 2N, K]; c [T * top_k, N]; weights [T * top_k] fp32
    sorted_token_ids, expert_ids, num_tokens_post_padded,  # int32 [max_padded], [max_blocks], [1]
    N, K, num_valid,  # num_valid = T * top_k: a sorted id >= this is padding
    stride_am, stride_be, stride_bn, stride_cm,
    rows_per_token,  # pair p reads row p // rows_per_token of a (top_k; 1: a holds one row per pair)
    tiles_m, group_size_m,  # row tiles in the grid; row tiles that walk the column tiles together
    GATED: tl.constexpr,  # b holds [W1; W3]: write silu(a W1^T) * (a W3^T)
    MUL_ROUTED_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grouped order over a 1-D grid: group_size_m row tiles take column tile 0, then 1, ...; the
    # programs resident at once share their column tiles (one expert's weights, mostly) through L2.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = group_size_m * tiles_n
    first_m = (pid // in_group) * group_size_m
    group_m = tl.minimum(tiles_m - first_m, group_size_m)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded):
        return  # past the padded end: this step routed fewer pairs than the worst case
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids + offs_m)  # [BLOCK_M] (token, k) pair ids of this tile's rows
    valid = pair < num_valid
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_ok = offs_n < N
    a_rows = A + (pair // rows_per_token).to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
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


def align_unsorted(topk_ids: torch.Tensor, block_m: int):
    """moe_align_block_size without the sort, for a step of one or two tokens: pair p gets tile p of
    its own (row p * block_m holds it, the rest is padding), so expert_ids is topk_ids itself. Two
    pairs on one expert then read its weights twice, which the sort would have saved; at T * top_k
    <= E / 4 that is rare, and three small ops replace a dozen."""
    n = topk_ids.numel()
    sorted_ids = torch.full((n, block_m), n, dtype=torch.int32, device=topk_ids.device)  # [n, block_m]
    sorted_ids[:, 0] = torch.arange(n, dtype=torch.int32, device=topk_ids.device)
    total = torch.full((1,), n * block_m, dtype=torch.int32, device=topk_ids.device)
    return sorted_ids.view(-1), topk_ids.reshape(-1).to(torch.int32), total


def _launch(a, b, c, weights, sorted_ids, expert_ids, num_post, N, K, num_valid, rows_per_token, gated, cfg):
    tiles_m = sorted_ids.numel() // cfg["BLOCK_M"]
    grid = (tiles_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_post, N, K, num_valid,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), rows_per_token, tiles_m, cfg["GROUP_SIZE_M"],
        GATED=gated, MUL_ROUTED_WEIGHT=not gated, IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fused_experts(x, w13, w2, topk_weights, topk_ids, config: dict | None = None):
    """sum_k topk_weights[t, k] * MLP_{topk_ids[t, k]}(x[t]) for every token: x [T, H] -> [T, H].

    w13 [E, 2I, H]: each expert's gate (rows 0..I) and up (rows I..2I) projections; w2 [E, H, I].
    config: the tiles (CONFIG_KEYS); None looks them up (`get_config`)."""
    _check(x, w13, w2, topk_weights, topk_ids, strict=True)
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if T == 0:
        return torch.empty_like(x)
    cfg = config or get_config(T, E, I, top_k, x.dtype, x.device)
    if sorted(cfg) != sorted(CONFIG_KEYS):
        raise ValueError(f"config must have exactly the keys {CONFIG_KEYS}, got {sorted(cfg)}")
    n = T * top_k
    if n * 4 <= E:  # one or two tokens: no sort
        sorted_ids, expert_ids, num_post = align_unsorted(topk_ids, cfg["BLOCK_M"])
    else:
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg["BLOCK_M"], E)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()  # [T * top_k], pair order
    inter = torch.empty((n, I), dtype=x.dtype, device=x.device)  # silu(gate) * up, per pair
    down = torch.empty((n, H), dtype=x.dtype, device=x.device)
    _launch(x, w13, inter, weights, sorted_ids, expert_ids, num_post, I, H, n, top_k, True, cfg)
    _launch(inter, w2, down, weights, sorted_ids, expert_ids, num_post, H, I, n, 1, False, cfg)
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
