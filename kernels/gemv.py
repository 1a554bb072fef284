"""A decode GEMV (chapter 18): y [M <= 8, N] = x [M, K] @ W [N, K]^T, split over K, in one launch, with
the decode layer's neighbours fused in, and programmatic dependent launch (PDL).

    prologue (NORM):      RMSNorm of x's rows (the norm's gain g [K] and eps)
    epilogue (SILU_MUL):  W stacks gate [I, K] over up [I, K]; y = silu(x W_gate^T) * (x W_up^T)  [M, I]
             (RESIDUAL):  y = y + residual [M, N]          (o_proj and down_proj close the residual stream)

At batch 1 a projection is a read of W at the copy bandwidth, or should be: 2-5 µs for the small
models' shapes, as short as a kernel's ramp-up and tail. So the grid is many small tiles, each a
[BLOCK_N, BLOCK_K] piece of W read once with wide loads, so that all 132 SMs of an H200 have many
bytes in flight from the first microsecond:

    program (n, s)  reads W[n*BN : (n+1)*BN, s*BK : (s+1)*BK], multiplies it by each of the M rows of x
                    over the same K slice, and writes its [M, BN] fp32 partial sums to a workspace;
    the last program of column tile n to finish (a per-tile counter, atomically incremented) adds
                    the SPLIT partials in the order s = 0, 1, ..., SPLIT - 1, applies the epilogue, writes
                    y, and puts the counter back to 0 for the next launch.

The reduction order is fixed: BLOCK_N and BLOCK_K come from (N, K) only (`gemv_config`), each row of x
is its own [BLOCK_N, BLOCK_K] multiply whatever M is, and the partials meet in split order. So a row's
result does not depend on M nor on which program finished last: a sequence decodes the same alone or in
a batch (bitwise, on one GPU).

RMSNorm commutes with the split: norm(x) W^T = rstd * ((x * g) W^T) with rstd = rsqrt(mean(x^2) + eps)
one number per row. Each program adds up its slice's squares next to its partials; the finishing one
adds those too and scales. x is read once, not once per program for its statistics.

PDL (Hopper+, Triton's `launch_pdl=True`): the next kernel of the stream may start while this one
runs; `gdc_wait()` blocks until the previous kernel has finished and its writes are visible. Every
program loads its W tile (weights: no kernel writes them) *before* waiting, then waits, then reads x
and the residual and writes anything. So the weight stream of this projection starts under the tail of
the previous kernel; and `gdc_launch_dependents()` lets the next kernel be scheduled as soon as every
program of this one is running. Both are no-ops without PDL. Triton's interpreter has neither, so
they are compiled in only when pdl=True (a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .activation import silu_and_mul_ref
from .checks import check_float_tensor
from .rms_norm import rms_norm_ref

MAX_M = 8  # more rows than this: a real GEMM (cuBLAS) reads W as fast and computes far faster
NUM_SMS = 132  # an H200's (and an H100 SXM's) multiprocessors: the grid wants several programs on each
MAX_TILES = 1 << 15  # column tiles a launch may have (the counters' buffer): N / BLOCK_N of a 128k vocab = 8016

# (N, K, silu_mul) -> (BLOCK_N, BLOCK_K, num_warps), measured winners (scripts/gpu/floor_gemv.py prints
# the best of its sweep per shape); a shape not listed gets gemv_config's rule.
GEMV_CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int]] = {}


def gemv_config(N: int, K: int, silu_mul: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for W [N, K]: independent of M (the reduction order must be).

    BLOCK_K: 512 bf16 numbers (1 KiB) per row of a tile for long rows, 256 for short (K = 576 would
    waste 44 % of a 1024-wide tile's lanes). BLOCK_N: the largest of 32, 16, 8, 4 that still gives
    >= 4 programs per SM, so a small projection is spread over every SM rather than fed by a few."""
    if (N, K, silu_mul) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(N, K, silu_mul)]
    block_k = 512 if K >= 2048 else 256
    split = triton.cdiv(K, block_k)
    n_out = N // 2 if silu_mul else N
    block_n = 32 if not silu_mul else 16  # SILU_MUL reads two tiles (gate, up) per program
    while block_n > 4 and triton.cdiv(n_out, block_n) * split < 4 * NUM_SMS:
        block_n //= 2
    return block_n, block_k, 4


@triton.jit
def _finish(acc, acc_up, ss, offs_n, n_ok, m, N_OUT, K, eps, bias_ptr, res_ptr, out_ptr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """Row m's epilogue on its full sums acc [BLOCK_N] (acc_up: the up half's; ss: sum of x^2 over K):
    the unfused ops' roundings (F.linear rounds once after its bias, F.silu and the product each round,
    the residual add rounds)."""
    dtype = out_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)
        acc = acc * rstd
        acc_up = acc_up * rstd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N_OUT + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(dtype)
    if SILU_MUL:
        g = y.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype)
        y = (s.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    if HAS_RES:
        r = tl.load(res_ptr + m * N_OUT + offs_n, mask=n_ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out_ptr + m * N_OUT + offs_n, y, mask=n_ok)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, K], rows stride_wn apart; SILU_MUL: N = 2 * N_OUT, gate rows then up rows
    norm_w_ptr,  # [K] (NORM)
    bias_ptr,  # [N] (HAS_BIAS)
    res_ptr,  # [M, N_OUT] contiguous (HAS_RES)
    out_ptr,  # [M, N_OUT] contiguous
    part_ptr,  # [SPLIT, M, N] fp32 partial sums (SPLIT > 1)
    sq_ptr,  # [n_tiles, SPLIT, M] fp32 partial sums of x^2 (NORM, SPLIT > 1)
    count_ptr,  # [>= n_tiles] int32, zero between launches
    N_OUT, K, stride_xm, stride_wn, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n, pid_s = pid // SPLIT, pid % SPLIT  # the SPLIT programs of a column tile are neighbours
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N_OUT
    offs_k = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_ok = offs_k < K
    N = 2 * N_OUT if SILU_MUL else N_OUT  # the workspace's row length

    # Weights first: nothing this step writes them, so they stream in before the wait.
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    w_mask = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows, mask=w_mask, other=0.0).to(tl.float32)
    u = w
    if SILU_MUL:
        u = tl.load(w_rows + N_OUT * stride_wn, mask=w_mask, other=0.0).to(tl.float32)
    g = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32) if NORM else tl.zeros([BLOCK_K],
                                                                                              tl.float32)
    if PDL:
        gdc_wait()  # the previous kernel (x's, the residual's producer) is done; its writes are visible
        gdc_launch_dependents()  # every program of ours is running: the next kernel may start its prefetch

    for m in tl.static_range(M):  # each row its own [BLOCK_N, BLOCK_K] multiply: the same order for any M
        xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        ss = tl.sum(xm * xm, axis=0) if NORM else 0.0
        if NORM:
            xm = xm * g
        acc = tl.sum(w * xm[None, :], axis=1)  # [BLOCK_N]
        acc_up = tl.sum(u * xm[None, :], axis=1) if SILU_MUL else acc
        if SPLIT == 1:
            _finish(acc, acc_up, ss, offs_n, n_ok, m, N_OUT, K, eps, bias_ptr, res_ptr, out_ptr,
                    NORM, HAS_RES, HAS_BIAS, SILU_MUL)
        else:
            part = part_ptr + (pid_s * M + m) * N + offs_n
            tl.store(part, acc, mask=n_ok)
            if SILU_MUL:
                tl.store(part + N_OUT, acc_up, mask=n_ok)
            if NORM:
                tl.store(sq_ptr + (pid_n * SPLIT + pid_s) * M + m, ss)

    if SPLIT > 1:
        tl.debug_barrier()  # all of this program's partials are stored before it counts itself in
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # release ours, acquire the others'
        if done == SPLIT - 1:  # the tile's last program: sum the partials in split order
            for m in tl.static_range(M):
                acc = tl.zeros([BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_N], tl.float32)
                ss = 0.0
                if NORM:  # the splits' sums of squares, as one vector (a fixed-shape sum: a fixed order)
                    offs_s = tl.arange(0, SPLIT_P2)
                    sqs = tl.load(sq_ptr + (pid_n * SPLIT + offs_s) * M + m, mask=offs_s < SPLIT, other=0.0,
                                  cache_modifier=".cg")
                    ss = tl.sum(sqs, axis=0)
                for s in range(SPLIT):  # fixed order: s = 0, 1, ... whoever finished last
                    # .cg: from L2, where the other SMs' stores are; not a stale L1 line
                    part = part_ptr + (s * M + m) * N + offs_n
                    acc += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                    if SILU_MUL:
                        acc_up += tl.load(part + N_OUT, mask=n_ok, other=0.0, cache_modifier=".cg")
                _finish(acc, acc_up, ss, offs_n, n_ok, m, N_OUT, K, eps, bias_ptr, res_ptr, out_ptr,
                        NORM, HAS_RES, HAS_BIAS, SILU_MUL)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (graphs replay this one)


_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The per-tile counters, zero between launches (each launch's last programs put them back). Made on
    the first (warm-up) call: never inside a CUDA graph's capture. Launches of one stream share them:
    a launch touches them only after its gdc_wait, when the previous launch is done."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def _check(x, weight, bias, norm_weight, residual, silu_mul):
    check_float_tensor("x", x, dims=2, layout="[M, K]")
    check_float_tensor("weight", weight, dims=2, layout="[N, K]")
    M, K = x.shape
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv takes 1 to {MAX_M} rows, got M = {M}")
    if weight.shape[1] != K or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [N, {K}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    N = weight.shape[0]
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs gate and up rows stacked (an even N), got N = {N}")
    n_out = N // 2 if silu_mul else N
    for name, t, shape in (("bias", bias, (N,)), ("norm_weight", norm_weight, (K,)),
                           ("residual", residual, (M, n_out))):
        if t is None:
            continue
        check_float_tensor(name, t)
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {list(shape)} {x.dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous, got strides {residual.stride()}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
         silu_mul: bool = False, pdl: bool = False, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """epilogue(prologue(x) @ weight^T + bias) for x [M <= 8, K], weight [N, K]; one launch.

    norm_weight [K] (and eps): RMSNorm x's rows first. silu_mul: weight is gate over up ([2I, K]), the
    result silu(gate) * up [M, I]. residual [M, N_out]: added last. pdl: launch with programmatic
    dependent launch (a Hopper GPU; not under the interpreter). config: (BLOCK_N, BLOCK_K, num_warps),
    else gemv_config's (for sweeps). -> [M, N_out] in x's dtype."""
    _check(x, weight, bias, norm_weight, residual, silu_mul)
    M, K = x.shape
    N = weight.shape[0]
    n_out = N // 2 if silu_mul else N
    block_n, block_k, num_warps = config or gemv_config(N, K, silu_mul)
    split, n_tiles = triton.cdiv(K, block_k), triton.cdiv(n_out, block_n)
    if n_tiles > MAX_TILES:
        raise ValueError(f"gemv has counters for {MAX_TILES} column tiles, N = {n_out} needs {n_tiles}")
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    part = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    sq = torch.empty((n_tiles, split, M) if split > 1 and norm_weight is not None else (1,),
                     dtype=torch.float32, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(n_tiles * split,)](
        x, weight, norm_weight, bias, residual, out, part, sq, _counter(x.device),
        n_out, K, x.stride(0), weight.stride(0), float(eps),
        M=M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, SPLIT_P2=triton.next_power_of_2(split),
        NORM=norm_weight is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        PDL=pdl, num_warps=num_warps, **extra,
    )
    return out


def gemv_ref(x, weight, bias=None, *, norm_weight=None, eps=1e-6, residual=None, silu_mul=False, **_):
    """The unfused ops in plain PyTorch: RMSNorm, F.linear, SiLU-and-mul, the residual add."""
    _check(x, weight, bias, norm_weight, residual, silu_mul)
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    out = torch.nn.functional.linear(x, weight, bias)  # [M, N]
    if silu_mul:
        out = silu_and_mul_ref(out)  # [M, N / 2]
    if residual is not None:
        out = out + residual  # one add, rounded to the dtype
    return out
