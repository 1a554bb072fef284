"""W4A16 at decode sizes (M <= 4 rows): a GEMV that streams the int4 weight, with no tl.dot.

At M = 1 a linear layer is a matrix-vector product: each weight is read once and used for one
multiply-add. The time is the weight's bytes over the memory bandwidth only if the GPU can also
*dequantize* a weight in the time its bytes take to arrive. int4 bytes arrive fast: at ~3 TB/s an
H100 receives ~6 G weights per ms and has ~32 G lane-operations per ms, about 5 operations a weight
for everything (unpack, convert, scale, add the min, multiply by x, add). w4a16.py's tiles spend
more: tl.dot pads one row to 16 and moves every dequantized tile into the tensor cores' operand
layout. So this kernel does what a GEMV does -- multiply and sum in the FP32 lanes -- with as few
operations per weight as the format allows:

  * The layout: qweight uint8 [N, K/2] (w4a16.pack_int4) read as int32 [N, K/8], a zero-copy view.
    Little-endian, int32 c of a row holds k = 8c + i in bits 4i..4i+3. Each lane loads 16 bytes of a
    row (32 weights) at once, and a K tile of 8 * BLOCK_C weights spans several groups (each int32
    gathers its own group's scale and min), so a row is read in runs of 4 * BLOCK_C bytes.
  * The bit trick: OR-ing q into the mantissa of 1.0 at bits 19..22 makes the float 1 + q/16
    exactly: one shift, then one AND-OR (a single LOP3) -- no integer-to-float conversion.
  * The zero point folded: with f = 1 + q/16, W = q s + m = 16 s f + (m - 16 s). For the 8 weights
    of one int32 (one group) the sum  sum_i x_i W_i = 16 s (sum_i x_i f_i) + (m - 16 s) (sum_i x_i),
    so a weight costs one FMA (x f into a running sum) and the scale and min are applied once per
    8 weights. About 3 lane-operations a weight at M = 1, one more FMA for each further row.
  * Weights streamed with eviction_policy="evict_first" (read once, never again this step); x and
    the scales stay cached (x is re-read by every program).
  * Split-K reduced in the kernel, in a fixed order: with few output tiles (N = 4096 over a 132-SM
    GPU) K is cut into SPLIT_K slices. Each program writes its fp32 partial, then bumps a counter
    for its N tile; the program that arrives last sums the SPLIT_K partials in slice order, writes y
    and resets the counter. No second kernel, and no atomics on the data: the same input gives the
    same bits (an atomic add of floats would not). The counters are a zeroed int32 buffer per device
    that every call leaves zeroed (calls on one stream at a time, as the engine runs them).

Every row runs the same code, so a row's result does not depend on the other rows of its batch
(M <= MAX_ROWS). The arithmetic is fp32 throughout (x upcast, weights never rounded to x's dtype) and
rounds once, to x's dtype, at the store: the reference `w4a16_gemv_ref` is the fp32 product with the
fp32-dequantized weight.

It measured slower than w4a16_swap.py's tensor-core kernel at M = 1 and 4, and Nsight Compute finds it
neither DRAM-bound nor issue-bound (chapter 08 and chapters/bench/ hold the dated runs). So w4a16_gemm
does not run it by default (w4a16.GEMV_M = 0); it stays here, tested, as the starting point, and its
split_k_finish is the swap kernel's too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INTERPRET
from .flash_decode import sm_count

MAX_ROWS = 4  # the most rows one call takes (every row costs one more FMA a weight)
MAX_SPLIT_K = 16


@triton.jit
def _w4a16_gemv_kernel(
    X, QW, S, Mins, Y, P, Counters,  # x [M, K]; qweight as int32 [N, K/8]; scales, mins [N, K/G]; y [M, N]
    M, N, K, group_size, k_per_split,  # k_per_split: K columns a slice sums, a multiple of 8 * BLOCK_C
    stride_xm, stride_qn, stride_sn, stride_ym,  # stride_qn in int32 elements
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x (all of them: M <= BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels = rows of W
    offs_c = tl.arange(0, BLOCK_C)  # [BLOCK_C] int32 columns of a K tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = QW + offs_n.to(tl.int64)[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = offs_n.to(tl.int64)[:, None] * stride_sn  # [BLOCK_N, 1]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], dtype=tl.float32)  # summed over c once, at the end
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, 8 * BLOCK_C):
        cols = k0 // 8 + offs_c  # [BLOCK_C] int32 columns: k = 8 * cols + i
        c_ok = cols < k_hi // 8  # the last tile may overhang the slice (K is a multiple of 32)
        w_ok = n_ok[:, None] & c_ok[None, :]
        packed = tl.load(w_rows + cols[None, :], mask=w_ok, other=0,
                         eviction_policy="evict_first")  # [BLOCK_N, BLOCK_C] int32, 8 weights each
        g = (8 * cols) // group_size  # [BLOCK_C] each int32's group (8 divides the group size)
        s16 = 16.0 * tl.load(S + s_rows + g[None, :], mask=w_ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_C]
        bias = tl.load(Mins + s_rows + g[None, :], mask=w_ok, other=0.0).to(tl.float32) - s16  # m - 16 s
        xf = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], dtype=tl.float32)  # sum_i x_i f_i per int32
        xs = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)  # sum_i x_i per int32 (shared by all rows of W)
        for i in tl.static_range(8):
            # nibble i (bits 4i..4i+3) to bits 19..22, the top of float32's mantissa: 1 + q/16 exactly
            if 19 - 4 * i >= 0:
                bits = packed << (19 - 4 * i)
            else:
                bits = packed >> (4 * i - 19)  # arithmetic shift: the sign bits land above bit 22, masked
            f = ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)  # [BLOCK_N, BLOCK_C]
            x = tl.load(x_rows + (8 * cols + i)[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0,
                        eviction_policy="evict_last").to(tl.float32)  # [BLOCK_M, BLOCK_C]
            xf += x[:, None, :] * f[None, :, :]  # one FMA per weight and row
            xs += x
        acc += xf * s16[None, :, :] + xs[:, None, :] * bias[None, :, :]
    part = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N] this slice's sums, fp32
    split_k_finish(part, Y, P, Counters, offs_m, offs_n, m_ok, n_ok, N, stride_ym, pid_n, split, M, SPLIT_K)


@triton.jit
def split_k_finish(part, Y, P, Counters, offs_m, offs_n, m_ok, n_ok, N, stride_ym, pid_n, split, M,
                    SPLIT_K: tl.constexpr):
    """part [BLOCK_M, BLOCK_N] fp32, one K slice's sums: stored as y (one slice), else written as the
    slice's partial; the last slice of the N tile to arrive sums all of them in slice order."""
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, part.to(Y.dtype.element_ty), mask=y_ok)
    else:
        mn = offs_m[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] within one slice's partial
        tl.store(P + split * M * N + mn, part, mask=y_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release)
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")  # slices done before this one
        if arrived == SPLIT_K - 1:  # the last slice of this tile: sum all of them, in slice order
            total = tl.zeros(part.shape, dtype=tl.float32)
            for s in range(SPLIT_K):  # .cg: read L2, where the other SMs' partials are
                total += tl.load(P + s * M * N + mn, mask=y_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(Counters + pid_n, 0)  # zeroed again for the next call


_counters: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters on `device`, kept (every call leaves it zeroed)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _counters[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return buf


def few_rows_output(kernel: str, x: torch.Tensor, qweight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """The [M, N] output of a kernel for at most max_rows rows of x (the GEMV's and the swap kernel's)."""
    if x.shape[0] > max_rows:
        raise ValueError(f"{kernel} takes at most {max_rows} rows, got {x.shape[0]}")
    return torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]


def split_k_buffers(y: torch.Tensor, split: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials fp32 [split, M, N], counters per N tile) for a split-K launch; with one split the kernel
    writes y directly and touches neither (y stands in for both)."""
    if split == 1:
        return y, y
    return torch.empty((split, *y.shape), dtype=torch.float32, device=y.device), split_k_counters(y.device, n_tiles)


def choose_gemv_tiles(N: int, K: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_C, split_k, num_warps, num_stages), the same for every M <= MAX_ROWS.

    BLOCK_C = 32 int32 is a 256-weight K tile: 128 bytes of each row per step, 16 per lane. Split-K
    brings the programs to about 8 per SM, enough 2-warp programs to keep the loads in flight."""
    if INTERPRET:
        bn, bc, warps, stages = 16, 8, 1, 1  # small tiles: the CPU tests' small shapes cross several
    else:
        bn, bc, warps, stages = 16, 32, 2, 2
    k_tiles = triton.cdiv(K, 8 * bc)
    split = triton.cdiv(8 * sm_count(device), triton.cdiv(N, bn))
    return bn, bc, max(1, min(split, k_tiles, MAX_SPLIT_K)), warps, stages


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               *, tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ dequant(qweight)^T -> [M, N] in x's dtype, summed in fp32.

    Arguments as w4a16.w4a16_gemm's, which checks them and runs this kernel up to its GEMV_M rows;
    `tiles` overrides choose_gemv_tiles (the GPU sweep's knob)."""
    M, K = x.shape
    N = qweight.shape[0]
    y = few_rows_output("w4a16_gemv", x, qweight, MAX_ROWS)  # [M, N]
    if M == 0 or N == 0:
        return y
    bn, bc, split, warps, stages = tiles or choose_gemv_tiles(N, K, x.device)
    bk = 8 * bc
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_per_split)  # no empty slices
    qw32 = qweight.view(torch.int32) if qweight.stride(0) % 4 == 0 else qweight.contiguous().view(torch.int32)
    n_tiles = triton.cdiv(N, bn)
    partials, counters = split_k_buffers(y, split, n_tiles)
    _w4a16_gemv_kernel[(n_tiles, split)](
        x, qw32, scales, mins, y, partials, counters,
        M, N, K, group_size, k_per_split,
        x.stride(0), qw32.stride(0), scales.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_C=bc, SPLIT_K=split,
        num_warps=warps, num_stages=stages,
    )
    return y


def w4a16_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """w4a16_gemv in plain PyTorch: the weight dequantized in fp32, an fp32 product, rounded once."""
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2).float()  # [N, K] in k order
    N, K = q.shape
    w = q.view(N, K // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return (x.float() @ w.view(N, K).t()).to(x.dtype)  # [M, N]
