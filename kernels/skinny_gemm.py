"""A skinny GEMM (M <= 8 rows: a decode step of a few sequences) with the decode layer's neighbours
fused in: the residual add + RMSNorm before it, SiLU-and-mul after it.

    out = epilogue( prologue(x) @ W^T + bias )      x [M, K], W [N, K] (nn.Linear's layout)

    prologue (NORM):  h = x + residual      (RES; written once, to new_residual, by program 0)
                      a = w_norm * (h * rsqrt(mean(h^2) + eps))
    epilogue (SILU_MUL): W stacks gate [I, K] over up [I, K]; out = silu(a W_gate^T) * (a W_up^T)

At batch 1 a decode layer's kernels are each a few microseconds of launch and ramp around a little
work, so fewer launches is the win: RMSNorm + QKV projection becomes one kernel, and RMSNorm + gate_up
projection + SiLU-and-mul another (chapter 13). With M this small the GEMM is a matrix-vector product
bound by reading W once: program p owns BLOCK_N output columns (and, with SILU_MUL, the matching up
columns), walks K in BLOCK_K steps, and multiplies each [BLOCK_N, BLOCK_K] tile of W by the M rows
of a held in registers (a broadcast multiply and a sum over K, in fp32: no tensor-core tile needs
M padded to 16). Each program also needs the rows' RMS, over all of K: it reads the rows once more
for it first (M x K numbers from L2, small beside W's N x K).

Roundings are the unfused kernels' (rms_norm.py, a cuBLAS GEMM, activation.py): h rounded to the
dtype, the normalized h rounded, then the weight's multiply rounded; the GEMM in fp32 rounded once
(after its bias); silu(gate) rounded, then its product with up rounded. What differs is only the
order of fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_ref
from .checks import check_float_tensor
from .rms_norm import rms_norm_ref

MAX_M = 8  # more rows than this: a real GEMM (cuBLAS) reads W as fast and computes far faster


@triton.jit
def _load_rows(x_ptr, res_ptr, new_res_ptr, offs_m, offs_k, M, K, rows_out, stride_xm, HAS_RES: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of x, plus the residual (rounded to the dtype); its first rows_out rows
    (M or 0: one program writes them) stored to new_res. res and new_res: contiguous [M, K]."""
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        out_mask = (offs_m < rows_out)[:, None] & (offs_k < K)[None, :]
        tl.store(new_res_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=out_mask)
    return x


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, res_ptr, new_res_ptr,  # [M, K]: x's rows stride_xm apart; res, new_res contiguous
    norm_w_ptr,  # [K] (NORM)
    w_ptr,  # [N, K] contiguous rows (stride_wn apart); with SILU_MUL N = 2 * N_OUT: gate rows, then up rows
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N_OUT] contiguous
    M, N_OUT, K, stride_xm, stride_wn, eps,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N_OUT
    rows_out = tl.where(pid == 0, M, 0)  # one program writes the new residual stream
    dtype = x_ptr.dtype.element_ty

    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # pass 1: each row's mean square, over all of K
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            h = _load_rows(x_ptr, res_ptr, new_res_ptr, offs_m, offs_k, M, K, rows_out, stride_xm,
                           HAS_RES).to(tl.float32)
            ss += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(ss / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # (SILU_MUL only)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = offs_k < K
        mask = m_ok[:, None] & k_ok[None, :]
        if NORM:
            h = _load_rows(x_ptr, res_ptr, new_res_ptr, offs_m, offs_k, M, K, 0, stride_xm, HAS_RES)
            g = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = (h.to(tl.float32) * rstd[:, None]).to(dtype)  # rounded as RMSNorm rounds it
            a = (g[None, :] * a.to(tl.float32)).to(dtype)  # ... then the weight's multiply, rounded
        else:
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        a = a.to(tl.float32)[:, None, :]  # [BLOCK_M, 1, BLOCK_K]
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(a * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        if SILU_MUL:
            u = tl.load(w_rows + N_OUT * stride_wn + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += tl.sum(a * u[None, :, :], axis=2)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N_OUT + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)  # the GEMM's output, rounded once
    if SILU_MUL:
        gate = out.to(tl.float32)
        s = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu, rounded
        out = (s.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    out_mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + offs_m[:, None] * N_OUT + offs_n[None, :], out, mask=out_mask)


def _check(x, weight, bias, norm_weight, residual, silu_mul):
    check_float_tensor("x", x, dims=2, layout="[M, K]")
    check_float_tensor("weight", weight, dims=2, layout="[N, K]")
    M, K = x.shape
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_M} rows, got M = {M}")
    if weight.shape[1] != K or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [N, {K}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if weight.stride(0) < K:
        raise ValueError(f"weight's rows must not overlap (row stride >= K = {K}), got strides {weight.stride()}")
    N = weight.shape[0]
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs gate and up rows stacked (an even N), got N = {N}")
    for name, t, shape in (("bias", bias, (N,)), ("norm_weight", norm_weight, (K,)), ("residual", residual, (M, K))):
        if t is None:
            continue
        check_float_tensor(name, t)
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {list(shape)} {x.dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous, got strides {residual.stride()}")
    if residual is not None and norm_weight is None:
        raise ValueError("residual is added before the norm: pass norm_weight with it")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """epilogue(prologue(x) @ weight^T + bias) for x [M <= 8, K], weight [N, K]: one launch.

    norm_weight [K] (and eps): RMSNorm x first; with residual [M, K], of x + residual, and then returns
    (out, x + residual) (the residual stream's next value, a new tensor). silu_mul: weight is gate over
    up ([2I, K]) and out is silu(gate) * up [M, I]. Everything in x's dtype.
    """
    _check(x, weight, bias, norm_weight, residual, silu_mul)
    M, K = x.shape
    N_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((M, N_out), dtype=x.dtype, device=x.device)
    new_res = torch.empty((M, K), dtype=x.dtype, device=x.device) if residual is not None else None
    BLOCK_M = triton.next_power_of_2(M)
    BLOCK_N = 8 if silu_mul else 16
    # about 4K products per step in flight: fewer K per step when more rows share a tile
    BLOCK_K = max(32, min(triton.next_power_of_2(K), 4096 // (BLOCK_M * BLOCK_N)))
    _skinny_gemm_kernel[(triton.cdiv(N_out, BLOCK_N),)](
        x, residual, new_res if new_res is not None else residual, norm_weight, weight, bias, out,
        M, N_out, K, x.stride(0), weight.stride(0), float(eps),
        NORM=norm_weight is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )
    return out if residual is None else (out, new_res)


def skinny_gemm_ref(x, weight, bias=None, *, norm_weight=None, eps=1e-6, residual=None, silu_mul=False):
    """The unfused ops in plain PyTorch: (residual add +) RMSNorm, F.linear, SiLU-and-mul."""
    _check(x, weight, bias, norm_weight, residual, silu_mul)
    new_res = None
    if residual is not None:
        x, new_res = rms_norm_ref(x, norm_weight, eps, residual)
    elif norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    out = torch.nn.functional.linear(x, weight, bias)
    if silu_mul:
        out = silu_and_mul_ref(out)
    return out if residual is None else (out, new_res)
