"""RMSNorm, fused with the residual add, as one Triton kernel.

Every decoder layer runs, twice:

    residual = x + residual                                # read x, residual; write residual
    out = weight * (residual / sqrt(mean(residual^2) + eps))

PyTorch runs that as about eight kernels (add, cast, pow, mean, add eps, rsqrt, multiply, cast,
multiply by weight), each of which reads its input from GPU memory and writes its output back. For a
decode step, [T, H] is a handful of rows: the arithmetic is nothing, and the time goes to launching
kernels and moving the same H numbers through memory again and again.

The fused kernel gives each row to one program. The program loads the whole row into registers
(H <= 16K or so fits: BLOCK = next_power_of_2(H), the tail masked off), adds the residual, writes the
new residual, reduces the sum of squares, scales and writes the output: one read of x and residual,
one write of out and new_residual, one launch. It is as fast as memory allows, which is the best a
memory-bound op can do.

It also rounds exactly where the reference does, so the engine's output does not depend on which
one ran (up to the order of the fp32 sum, see the test):
    new_residual = x + residual         in x's dtype (PyTorch adds in fp32 and rounds once)
    y = (xf * rsqrt(mean(xf^2) + eps))  in fp32, rounded to x's dtype
    out = weight * y                    in fp32, rounded once to the promoted dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_float_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H], rows stride_x apart
    res_ptr,  # [T, H], rows stride_res apart (unused without HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H] contiguous
    new_res_ptr,  # [T, H], rows stride_new_res apart (unused without HAS_RESIDUAL); may be res_ptr
    stride_x,
    stride_res,
    stride_new_res,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next_power_of_2(H): the whole row in one tile
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < H  # H need not be a power of two (576, 1536, ...)
    # int64 row offsets: T * H passes 2^31 for a long prefill of a wide model.
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)  # [BLOCK], x's dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row.to(tl.int64) * stride_res + cols, mask=mask, other=0.0)
        # Add in fp32 and round to x's dtype, as PyTorch's `x + residual` does: the norm below reads the
        # rounded sum, the same numbers the next layer will add to.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        # In place (new_res_ptr == res_ptr) is safe: this program has read its whole row already.
        tl.store(new_res_ptr + row.to(tl.int64) * stride_new_res + cols, x, mask=mask)
    xf = x.to(tl.float32)  # [BLOCK]; masked lanes are 0 and add nothing to the sum
    # Divide by H, not BLOCK: the padding lanes are not part of the row.
    mean_sq = tl.sum(xf * xf, axis=0) / H  # scalar
    y = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)  # [BLOCK], rounded to x's dtype like the reference
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # One fp32 multiply, rounded once to out's dtype (PyTorch's bf16 * bf16 does the same).
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of x [T, H].

    With `residual` [T, H]: returns (norm(x + residual), x + residual), both new tensors; without,
    returns norm(x). The output's dtype is weight's and x's promoted together, as in the reference.
    """
    # x and residual: [T, H] float tensors whose rows may be strided but whose last dim is contiguous.
    check_float_tensor("x", x, dims=2, layout="[num_tokens, hidden]")
    H = x.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"weight must be a float16, bfloat16 or float32 tensor, got {getattr(weight, 'dtype', weight)}"
        )
    if weight.shape != (H,):
        raise ValueError(f"weight must have shape [hidden] = ({H},) to match x, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if residual is not None:
        check_float_tensor("residual", residual, dims=2, layout="[num_tokens, hidden]")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")

    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    out = _launch(x, weight, eps, residual, new_res)
    return out if residual is None else (out, new_res)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's fused_add_rms_norm: residual += x (in place, rounded to its dtype), and returns
    norm(residual) as a new tensor; one launch. x, residual: [T, H] of one dtype, last dim contiguous.

    The model's layers use `rms_norm(x, w, eps, residual)` instead, which leaves the residual it was
    given untouched: a caller may run a block twice on the same inputs (quantization calibration does).
    """
    for name, t in (("x", x), ("residual", residual)):
        check_float_tensor(name, t, dims=2, layout="[num_tokens, hidden]")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    rms_norm(x[:0], weight, eps, residual[:0])  # the weight, dtype and device checks, on no rows
    return _launch(x, weight, eps, residual, residual)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """fused_add_rms_norm in plain PyTorch: the same in-place update, the same output."""
    out, new_res = rms_norm_ref(x, weight, eps, residual)
    residual.copy_(new_res)
    return out


def _launch(x, weight, eps, residual, new_res) -> torch.Tensor:
    T, H = x.shape
    weight = weight.contiguous()  # [H]; a no-op for a Parameter
    out = torch.empty((T, H), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if T == 0:
        return out
    BLOCK = triton.next_power_of_2(H)
    # Enough warps that each thread holds a few dozen numbers of the row, not hundreds (which spill).
    num_warps = min(max(BLOCK // 512, 1), 8)
    _rms_norm_kernel[(T,)](
        x,
        residual if residual is not None else x,  # a placeholder pointer the kernel never reads
        weight,
        out,
        new_res if new_res is not None else out,  # (a placeholder without a residual)
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        new_res.stride(0) if new_res is not None else 0,
        H,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch RMSNorm the kernel is tested against (x: [..., H])."""
    if residual is not None:
        x = x + residual  # rounded to x's dtype: the new residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # statistics in fp32
    out = weight * xf.to(dtype)
    return out if residual is None else (out, residual)
