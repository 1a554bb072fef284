"""W4A16 at decode sizes (M <= 16 rows) on the tensor cores, the weight as the MMA's register operand.

A decode step multiplies a few rows of x by every weight once. w4a16.py's tiles compute x W^T: the
int4 tile dequantized in registers becomes tl.dot's *B* operand, which Hopper's wgmma reads from
shared memory, so every dequantized weight takes a round trip through shared memory. w4a16_gemv.py
avoids the tensor cores altogether and spends the FP32 lanes on every multiply-add. This kernel
swaps the operands instead ("swap AB"): it computes y^T = W x^T, so the weight tile [BLOCK_N, k] is
the *A* operand, which wgmma takes from registers, and x^T [k, 16] (the rows padded to the smallest
MMA width by the load's mask) is the small B operand. Per weight the lanes do a mask and an OR:

  * q in 0..15 is exact in bf16 or fp16, so the dot can multiply by q itself and apply each group's
    scale and min to the group's sums: sum_k x_k (q_k s + m) = s (sum_k x_k q_k) + m (sum_k x_k).
    The tensor cores sum x q in fp32; the scales touch [BLOCK_N, 16] sums once per group.
  * The magic number: OR-ing q into the low mantissa bits of 128.0 (bf16 0x4300) or 1024.0 (fp16
    0x6400) makes the number 128 + q (1024 + q) exactly; subtracting 128 (1024) in the same dtype is
    exact too. No integer-to-float conversion.
  * The byte layout is pack_int4's (two weights a byte along K, low nibble = even k), unchanged: the
    low nibbles meet x's even columns and the high nibbles its odd columns, two dots per chunk.
  * Split-K over whole groups, reduced in the kernel in a fixed order as w4a16_gemv.py does (the
    last program of an N tile to finish sums the slices' fp32 partials in slice order): the same
    input gives the same bits, and the tiles and split depend on N and K only, and the MMA computes
    each of its 16 columns on its own, so a row's result does not depend on the other rows.

fp32 activations (a CPU-checked path, not a fast one) convert q directly and run the dots in IEEE
fp32. The reference is w4a16_gemv.w4a16_gemv_ref: the fp32 product with the fp32-dequantized weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INTERPRET
from .flash_attn import dot
from .flash_decode import sm_count
from .w4a16_gemv import few_rows_output, split_k_buffers, split_k_finish

MAX_ROWS = 16  # x's rows: the B operand's 16 columns
MAX_SPLIT_K = 16
MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}  # bits of OFFSET; OFFSET + q is exact


@triton.jit
def _w4a16_swap_kernel(
    X, QW, S, Mins, Y, P, Counters,  # x [M, K]; qweight uint8 [N, K/2]; scales, mins [N, K/G]; y [M, N]
    M, N, groups_per_split, n_groups,
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr, CHUNK: tl.constexpr,  # CHUNK bytes of a row per dot; it divides GROUP // 2
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, 16)  # [16] x's rows, the dot's columns
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels = rows of W
    offs_j = tl.arange(0, CHUNK)  # [CHUNK] bytes of a chunk
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = QW + offs_n.to(tl.int64)[:, None] * stride_qn + offs_j[None, :]  # [BN, CHUNK]
    s_rows = offs_n.to(tl.int64) * stride_sn  # [BN]
    xt_even = X + offs_m.to(tl.int64)[None, :] * stride_xm + 2 * offs_j[:, None]  # [CHUNK, 16]: x^T, even k
    g_lo = split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        qx = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # sum over the group of x q
        xsum = tl.zeros([16], dtype=tl.float32)  # sum over the group of x, per row of x
        for c in tl.static_range(GROUP // 2 // CHUNK):
            byte0 = g * (GROUP // 2) + c * CHUNK
            b = tl.load(w_rows + byte0, mask=n_ok[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, CHUNK] uint8: read once, never again this step
            xe = tl.load(xt_even + 2 * byte0, mask=m_ok[None, :], other=0.0)  # [CHUNK, 16] k = 2j
            xo = tl.load(xt_even + 2 * byte0 + 1, mask=m_ok[None, :], other=0.0)  # [CHUNK, 16] k = 2j + 1
            if MAGIC_BITS:
                b16 = b.to(tl.int16)
                lo = (((b16 & 0xF) | MAGIC_BITS).to(X.dtype.element_ty, bitcast=True) - OFFSET).to(X.dtype.element_ty)
                hi = (((b16 >> 4) | MAGIC_BITS).to(X.dtype.element_ty, bitcast=True) - OFFSET).to(X.dtype.element_ty)
            else:
                lo = (b & 0xF).to(X.dtype.element_ty)
                hi = (b >> 4).to(X.dtype.element_ty)
            qx = dot(hi, xo, dot(lo, xe, qx, IEEE), IEEE)  # [BN, 16] fp32
            xsum += tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=0)
        s = tl.load(S + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        mn = tl.load(Mins + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        acc += qx * s[:, None] + mn[:, None] * xsum[None, :]
    split_k_finish(tl.trans(acc), Y, P, Counters, offs_m, offs_n, m_ok, n_ok, N, stride_ym, pid_n, split, M,
                    SPLIT_K)


def choose_swap_tiles(N: int, K: int, group_size: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, split_k, num_warps, num_stages), the same for every M <= MAX_ROWS.

    64 output channels a program, 4 warps, 4 stages; K cut into slices of whole groups until there
    are about 3 programs an SM: the best of the swap kernel's sweep on an H200 at M = 1 and 16 on
    Llama-3-8B's shapes (scripts/gpu/w4_variants.py --round2, chapters/bench/h200x2-2026-11-26/)."""
    bn, warps, stages = (16, 4, 1) if INTERPRET else (64, 4, 4)
    split = triton.cdiv(3 * sm_count(device), triton.cdiv(N, bn))
    return bn, max(1, min(split, K // group_size, MAX_SPLIT_K)), warps, stages


def swap_supports(x: torch.Tensor, group_size: int) -> bool:
    """Whether this kernel takes x: at most MAX_ROWS rows and a group of at least 32 weights (each chunk
    is a dot of K >= 16 bytes); bf16 or fp16 on a GPU, also fp32 under the interpreter (for the tests:
    an IEEE fp32 dot is exact there, slow on a GPU)."""
    if x.shape[0] > MAX_ROWS or group_size % 32:
        return False
    return x.dtype in MAGIC or (INTERPRET and x.dtype == torch.float32)


def w4a16_swap(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               *, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ dequant(qweight)^T -> [M, N] in x's dtype, summed in fp32.

    Arguments as w4a16.w4a16_gemm's, which checks them and runs this kernel where swap_supports says so;
    `tiles` overrides choose_swap_tiles (the GPU sweep's knob)."""
    M, K = x.shape
    N = qweight.shape[0]
    y = few_rows_output("w4a16_swap", x, qweight, MAX_ROWS)  # [M, N]
    if M == 0 or N == 0:
        return y
    bn, split, warps, stages = tiles or choose_swap_tiles(N, K, group_size, x.device)
    n_groups = K // group_size
    per_split = triton.cdiv(n_groups, split)
    split = triton.cdiv(n_groups, per_split)  # no empty slices
    chunk = min(128, (group_size // 2) & -(group_size // 2))  # the largest power of two dividing G/2, <= 128
    n_tiles = triton.cdiv(N, bn)
    partials, counters = split_k_buffers(y, split, n_tiles)
    magic_bits, offset = MAGIC.get(x.dtype, (0, 0.0))
    _w4a16_swap_kernel[(n_tiles, split)](
        x, qweight, scales, mins, y, partials, counters,
        M, N, per_split, n_groups,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group_size, CHUNK=chunk, BLOCK_N=bn, SPLIT_K=split,
        MAGIC_BITS=magic_bits, OFFSET=offset, IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return y
