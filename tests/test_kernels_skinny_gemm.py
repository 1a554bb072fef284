"""The skinny GEMM with its fused prologue (residual add + RMSNorm) and epilogue (SiLU-and-mul) against
the unfused ops in plain PyTorch, on fresh random inputs with odd sizes; and against the unfused
Triton kernels (rms_norm, silu_and_mul) around a torch GEMM, which round in the same places."""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels.activation import silu_and_mul
from minillm.kernels.rms_norm import rms_norm
from minillm.kernels.skinny_gemm import MAX_M, skinny_gemm, skinny_gemm_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
# fp32 off the interpreter: the GPU's rsqrt and exp are a few ulps off; bf16 under the interpreter
# truncates. A GEMM's sum in another order: a few ulps of the output's dtype at the sum's magnitude.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _tol(dtype, ref: torch.Tensor, terms: int) -> dict:
    # output rounding, plus an ulp of the input's rounding moved by the sum's order, over sqrt(K) terms
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=4 * eps * ref.abs().max().item() + 1e-6 * terms**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (3, 17, 72), (MAX_M, 33, 200)])
@pytest.mark.parametrize("norm,res,bias,silu", [
    (False, False, False, False), (True, False, False, False), (True, True, True, False),
    (True, True, False, True), (False, False, True, True),
])
def test_matches_the_unfused_ops(seed, dtype, M, N, K, norm, res, bias, silu):
    g = torch.Generator().manual_seed(seed)
    N = 2 * N if silu else N
    x = _rand(g, M, K + 5, dtype=dtype)[:, 3 : 3 + K]  # strided rows, as a slice of a wider buffer
    w = _rand(g, N, K, dtype=dtype, scale=K**-0.5)
    kw = dict(bias=_rand(g, N, dtype=dtype) if bias else None, silu_mul=silu,
              norm_weight=_rand(g, K, dtype=dtype, scale=0.2) + 1 if norm else None, eps=1e-5,
              residual=_rand(g, M, K, dtype=dtype, scale=2) if res else None)
    got, want = skinny_gemm(x, w, **kw), skinny_gemm_ref(x, w, **kw)
    if res:
        (got, got_res), (want, want_res) = got, want
        assert torch.equal(got_res, want_res)  # one add, rounded once
    assert got.shape == want.shape == (M, N // 2 if silu else N) and got.dtype == dtype
    torch.testing.assert_close(got, want, **_tol(dtype, want, K))
    # ... and to the unfused Triton kernels, which round where it does (only the GEMM's order differs)
    a = x
    if norm:
        a = rms_norm(x, kw["norm_weight"], 1e-5, kw["residual"])
        a = a[0] if res else a
    y = torch.nn.functional.linear(a, w, kw["bias"])
    y = silu_and_mul(y) if silu else y
    torch.testing.assert_close(got, y, **_tol(dtype, y, K))


def test_bad_input_is_refused():
    x, w = torch.randn(2, 16, device=DEVICE), torch.randn(6, 16, device=DEVICE)
    with pytest.raises(ValueError, match="takes 1 to 8 rows"):
        skinny_gemm(torch.randn(9, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_gemm(x, torch.randn(6, 15, device=DEVICE))
    with pytest.raises(ValueError, match="even N"):
        skinny_gemm(x, w[:5], silu_mul=True)
    with pytest.raises(ValueError, match="pass norm_weight"):
        skinny_gemm(x, w, residual=torch.randn(2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_gemm(x, w, norm_weight=torch.ones(15, device=DEVICE))
    with pytest.raises(ValueError, match="residual must be contiguous"):
        skinny_gemm(x, w, norm_weight=torch.ones(16, device=DEVICE),
                    residual=torch.randn(2, 32, device=DEVICE)[:, :16])
