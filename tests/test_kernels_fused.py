"""The small fused kernels (RMSNorm + residual, RoPE in place, SiLU-and-mul) against their PyTorch
references, on fresh random inputs: on a CPU under Triton's interpreter with small shapes, on a GPU
with the real shapes of SmolLM2-135M and Llama-3-8B.

How close is close enough. Each kernel rounds where its reference does, so what is left is:
- the order of fp32 sums and the last bit of fp32 exp/div/rsqrt, which differ between numpy (the
  interpreter), PyTorch's CPU kernels and the GPU. Where the inputs make every such result exact (RMSNorm
  on inputs on a grid of 1/16: every square and every partial sum is exact in fp32, in any order), the
  interpreter's output must equal the reference bit for bit. Elsewhere the outputs must agree to a unit
  or so in the last place (ulp), and in half precision be identical for nearly every element: a kernel
  that rounded in a different place would miss by a full ulp on a large share of them. (An ulp lost in
  an intermediate can show as two in the next rounded result, whose ulp may be half as large relative
  to its value; the bounds allow for that);
- the interpreter's fp32 -> bfloat16 conversion, which truncates instead of rounding to nearest even
  (numpy has no bfloat16; Triton emulates it). A GPU rounds correctly, so bf16 on a CPU is held to a
  looser ulp bound and bf16 exactness is checked on the GPU only.
"""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels.activation import silu_and_mul, silu_and_mul_ref
from minillm.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from minillm.kernels.rotary import apply_rotary_, apply_rotary_ref

# tests/conftest.py turns the interpreter on when there is no GPU; otherwise the kernels run natively.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in units in the last place of expected's dtype, at expected's magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    finfo = torch.finfo(expected.dtype)
    e = expected.double()
    _, exponent = torch.frexp(e.abs().clamp_min(finfo.tiny))  # |e| = m * 2^exponent, 0.5 <= m < 1
    ulp = torch.ldexp(torch.full_like(e, finfo.eps), exponent - 1)  # eps * 2^(exponent - 1)
    return (actual.double() - e).abs() / ulp


def assert_close_ulps(actual, expected, max_ulps: float, min_exact: float = 0.0) -> None:
    """Every element within max_ulps, and at least a min_exact share of them bit-identical.

    fp32 on a GPU gets 16 ulps and no exactness: its exp, rsqrt and division are a few ulps off the
    correctly rounded results PyTorch's kernels get (measured up to 7 on an H100)... Half precision,
    where a misplaced rounding would show, stays strict everywhere."""
    if not INTERPRETED and expected.dtype == torch.float32:
        # ... and where a sum cancels (rotary's x cos - y sin near 0) the error is relative to the
        # terms, not the tiny result: bound it by 16 ulps of the tensor's largest element.
        bound = 16 * torch.finfo(torch.float32).eps * expected.abs().max().item()
        worst = (actual.double() - expected.double()).abs().max().item()
        assert worst <= bound, f"fp32 on the GPU: off by {worst:.3g}, allowed {bound:.3g}"
        return
    err = ulps(actual, expected)
    assert err.max().item() <= max_ulps, f"off by up to {err.max().item():.2f} ulps (allowed {max_ulps})"
    exact = (actual == expected).float().mean().item()
    assert exact >= min_exact, f"only {exact:.2%} of elements identical (want {min_exact:.0%})"


def randn(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def on_grid(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Random multiples of 1/16 in [-4, 4]: exact in every dtype, and so are their squares and any sum
    of up to 2^11 of them in fp32 (at most 2^23 units of 1/256)."""
    return (torch.randint(-64, 65, shape, generator=g) / 16).to(dtype).to(DEVICE)


# --- RMSNorm -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 576), (5, 96)])
def test_rms_norm_rounds_like_reference(seed, dtype, T, H):
    g = torch.Generator().manual_seed(seed)
    x, res = on_grid(g, T, H, dtype=dtype), on_grid(g, T, H, dtype=dtype)
    weight = randn(g, H, dtype=dtype, scale=0.3) + 1
    eps = 1e-5
    out, new_res = rms_norm(x, weight, eps, res)
    ref_out, ref_res = rms_norm_ref(x, weight, eps, res)
    plain, ref_plain = rms_norm(x, weight, eps), rms_norm_ref(x, weight, eps)
    if INTERPRETED and dtype == torch.bfloat16:
        # Truncation (see the module docstring): an ulp in the sum, and one in each of the norm's two
        # roundings, each carried on as up to two ulps by the next step.
        assert_close_ulps(new_res, ref_res, 1)
        assert_close_ulps(out, ref_out, 6)
        assert_close_ulps(plain, ref_plain, 4)
    elif INTERPRETED:
        assert torch.equal(new_res, ref_res)
        assert torch.equal(out, ref_out)
        assert torch.equal(plain, ref_plain)
    else:
        # The GPU's fp32 division and rsqrt are not correctly rounded (nor PyTorch's, in their own
        # way): a rare last-bit flip of the normalized x, which the weight's multiply carries as up
        # to two ulps of the output.
        assert torch.equal(new_res, ref_res)
        assert_close_ulps(out, ref_out, 2, min_exact=0.99)
        assert_close_ulps(plain, ref_plain, 2, min_exact=0.99)


def test_rms_norm_promotes_like_reference(seed):
    # An fp32 weight with fp16 activations: the output is fp32, as in `weight * x.to(fp16)`.
    g = torch.Generator().manual_seed(seed)
    x, weight = on_grid(g, 3, 80, dtype=torch.float16), randn(g, 80)
    out, ref = rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    if INTERPRETED:
        assert torch.equal(out, ref)
    else:  # a flip of the fp16 normalized x is 2^13 fp32 ulps: bound it relative to fp16 instead
        torch.testing.assert_close(out, ref, rtol=2 * torch.finfo(torch.float16).eps, atol=0)
        assert (out == ref).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows_random_values(seed, dtype):
    # x and residual are column slices of wider buffers: rows stride apart, the last dim contiguous.
    g = torch.Generator().manual_seed(seed)
    T, H = 7, 192
    x = randn(g, T, H + 40, dtype=dtype)[:, 8 : 8 + H]  # [7, 192], row stride 232
    res = randn(g, T, 2 * H, dtype=dtype, scale=3)[:, H:]  # [7, 192], row stride 384
    weight = randn(g, H, dtype=dtype, scale=0.3) + 1
    x0, res0 = x.clone(), res.clone()
    out, new_res = rms_norm(x, weight, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-6, res)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    assert out.shape == new_res.shape == (T, H)
    if dtype == torch.bfloat16 and INTERPRETED:
        assert_close_ulps(new_res, ref_res, 1)
        assert_close_ulps(out, ref_out, 6)
    else:
        assert torch.equal(new_res, ref_res)  # one add, rounded once: no freedom left
        if dtype == torch.float32:  # the sum of squares in another order moves the scale a few ulps
            assert_close_ulps(out, ref_out, 8)
        else:  # ... which flips the rounded normalized x now and then: up to two ulps after the weight
            assert_close_ulps(out, ref_out, 2, min_exact=0.99)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_the_residual_in_place(seed, dtype):
    # vLLM's semantics: residual <- x + residual where it lies (a strided view here), normed output new.
    g = torch.Generator().manual_seed(seed)
    T, H = 5, 136
    x = on_grid(g, T, H, dtype=dtype)
    buf = on_grid(g, T, H + 24, dtype=dtype)
    res = buf[:, 8 : 8 + H]  # [5, 136], row stride 160
    weight = randn(g, H, dtype=dtype, scale=0.3) + 1
    res_ref, buf0 = res.clone(), buf.clone()
    ref = fused_add_rms_norm_ref(x, res_ref, weight, 1e-5)
    out = fused_add_rms_norm(x, res, weight, 1e-5)
    assert out.shape == (T, H) and out.data_ptr() != res.data_ptr()
    assert torch.equal(buf[:, :8], buf0[:, :8]) and torch.equal(buf[:, 8 + H :], buf0[:, 8 + H :])  # only res
    if INTERPRETED and dtype == torch.bfloat16:  # truncation, as in the test above
        assert_close_ulps(res, res_ref, 1)
        assert_close_ulps(out, ref, 6)
    else:
        assert torch.equal(res, res_ref)
        assert_close_ulps(out, ref, 0 if INTERPRETED else 2, min_exact=0.99)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        fused_add_rms_norm(x, res[:2], weight, 1e-5)
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        fused_add_rms_norm(x, res.float() if dtype != torch.float32 else res.half(), weight, 1e-5)


def test_rms_norm_no_rows():
    x = torch.empty(0, 64, device=DEVICE)
    out, new_res = rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, torch.empty(0, 64, device=DEVICE))
    assert out.shape == new_res.shape == (0, 64)


def test_rms_norm_rejects_bad_input():
    x, w = torch.randn(4, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="x must be 2-D"):
        rms_norm(x[0], w, 1e-6)
    with pytest.raises(TypeError, match="x must be float16"):
        rms_norm(x.long(), w, 1e-6)
    with pytest.raises(ValueError, match="x's last dim must be contiguous"):
        rms_norm(torch.randn(4, 128, device=DEVICE)[:, ::2], w, 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(63, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm(x, w.int(), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, w, 1e-6, torch.randn(3, 64, device=DEVICE))
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        rms_norm(x, w, 1e-6, torch.randn(4, 64, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual's last dim must be contiguous"):
        rms_norm(x, w, 1e-6, torch.randn(64, 4, device=DEVICE).t())


# --- RoPE ----------------------------------------------------------------------------------------


def _fused_qkv(g, T, Hq, Hkv, D, dtype):
    """q and k as strided views of one [T, (Hq + 2 Hkv) * D] buffer, as the qkv projection makes them."""
    qkv = randn(g, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)  # [T, Hq, D], token stride (Hq + 2 Hkv) * D
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)  # [T, Hkv, D]
    return qkv, q, k


def _cos_sin(g, T, D, dtype, three_d):
    # An independent angle for every coordinate (not the model's two equal halves), so a kernel that
    # took cos of the wrong half would fail.
    angles = torch.rand(T, D, generator=g) * 200 - 100  # [T, D]
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    return (cos[:, None, :], sin[:, None, :]) if three_d else (cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T,Hq,Hkv,D,three_d", [(1, 9, 3, 64, True), (7, 9, 3, 16, False), (3, 4, 4, 32, True)]
)
def test_rotary_in_place_on_fused_qkv(seed, dtype, T, Hq, Hkv, D, three_d):
    g = torch.Generator().manual_seed(seed)
    qkv, q, k = _fused_qkv(g, T, Hq, Hkv, D, dtype)
    cos, sin = _cos_sin(g, T, D, dtype, three_d)
    v_before = qkv[:, (Hq + Hkv) * D :].clone()
    ref_q, ref_k = apply_rotary_ref(q, k, cos, sin)  # new tensors, in the dtype's rounding
    once_q, once_k = (t.to(dtype) for t in apply_rotary_ref(q.float(), k.float(), cos.float(), sin.float()))

    out_q, out_k = apply_rotary_(q, k, cos, sin)
    assert out_q is q and out_k is k  # in place, the same views returned
    assert torch.equal(qkv[:, (Hq + Hkv) * D :], v_before)  # v, in the same buffer, untouched
    # The kernel rounds once from fp32: at most an ulp from that (the interpreter's bf16 truncates; a
    # GPU may fuse a multiply-add), and bit-identical under the interpreter otherwise.
    tight = 0 if INTERPRETED and dtype != torch.bfloat16 else 1
    assert_close_ulps(q, once_q, tight)
    assert_close_ulps(k, once_k, tight)
    # The reference rounds after each multiply and the add, so near-cancellations differ by an ulp of
    # the inputs, not of the result.
    for out, ref in ((q, ref_q), (k, ref_k)):
        atol = 4 * torch.finfo(dtype).eps * ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=0, atol=atol)


def test_rotary_separate_contiguous_q_k(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = randn(g, 5, 6, 32), randn(g, 5, 2, 32)
    cos, sin = _cos_sin(g, 5, 32, torch.float32, three_d=True)
    ref_q, ref_k = apply_rotary_ref(q, k, cos, sin)
    apply_rotary_(q, k, cos, sin)
    # fp32 throughout: the same three roundings as the reference, unless a GPU fuses a multiply-add.
    assert_close_ulps(q, ref_q, 0 if INTERPRETED else 2)
    assert_close_ulps(k, ref_k, 0 if INTERPRETED else 2)


def test_rotary_rejects_bad_input():
    q, k = torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    cos = sin = torch.randn(3, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="q and k must be 3-D"):
        apply_rotary_(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="k must be"):
        apply_rotary_(q, torch.randn(3, 2, 8, device=DEVICE), cos, sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        apply_rotary_(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="cos must have shape"):
        apply_rotary_(q, k, torch.randn(2, 1, 16, device=DEVICE), sin)
    with pytest.raises(TypeError, match="q must be float16"):
        apply_rotary_(q.long(), k, cos, sin)
    with pytest.raises(TypeError, match="q and k must share a dtype"):
        apply_rotary_(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="k's last dim must be contiguous"):
        apply_rotary_(q, torch.randn(3, 2, 32, device=DEVICE)[..., ::2], cos, sin)


# --- SiLU and mul --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 96), (2, 3, 2 * 40)])
def test_silu_and_mul_matches_reference(seed, dtype, shape):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, *shape, dtype=dtype, scale=3)  # wide enough that silu's tails are exercised
    out, ref = silu_and_mul(x), silu_and_mul_ref(x)
    assert out.shape == ref.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    if dtype == torch.float32:  # numpy's / the GPU's exp vs PyTorch's: the last bit or two, doubled
        assert_close_ulps(out, ref, 6)
    elif dtype == torch.bfloat16 and INTERPRETED:
        # Truncated twice: silu (an ulp, which the product carries as up to two of its own), then the
        # product (one more, and a margin).
        assert_close_ulps(out, ref, 4)
    else:
        # Rounded where PyTorch rounds, so only a rare last-bit flip of exp may show: an ulp of silu,
        # up to two of the product.
        assert_close_ulps(out, ref, 2, min_exact=0.99)


def test_silu_and_mul_strided_rows(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, 5, 2 * 48 + 16, dtype=torch.float16, scale=3)[:, 16:]  # [5, 96], row stride 112
    assert_close_ulps(silu_and_mul(x), silu_and_mul_ref(x), 2, min_exact=0.99)


def test_silu_and_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="x's last dim must be even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(TypeError, match="x must be float16"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="x's last dim must be contiguous"):
        silu_and_mul(torch.randn(8, 2, device=DEVICE).t())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        silu_and_mul([1.0, 2.0])


# --- Real shapes, natively on a GPU --------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "H,inter,Hq,Hkv,D", [(576, 1536, 9, 3, 64), (4096, 14336, 32, 8, 128)], ids=["smollm2-135m", "llama-3-8b"]
)
@pytest.mark.parametrize("T", [1, 257])
def test_real_shapes_bf16_on_gpu(seed, H, inter, Hq, Hkv, D, T):
    g, bf16 = torch.Generator().manual_seed(seed), torch.bfloat16
    x, res, weight = (
        randn(g, T, H, dtype=bf16),
        randn(g, T, H, dtype=bf16, scale=4),
        randn(g, H, dtype=bf16) + 1,
    )
    out, new_res = rms_norm(x, weight, 1e-5, res)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-5, res)
    assert torch.equal(new_res, ref_res)
    assert_close_ulps(out, ref_out, 2, min_exact=0.99)

    gate_up = randn(g, T, 2 * inter, dtype=bf16, scale=3)
    assert_close_ulps(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), 2, min_exact=0.99)

    qkv, q, k = _fused_qkv(g, T, Hq, Hkv, D, bf16)
    v_before = qkv[:, (Hq + Hkv) * D :].clone()
    cos, sin = _cos_sin(g, T, D, bf16, three_d=True)
    once_q, once_k = (t.to(bf16) for t in apply_rotary_ref(q.float(), k.float(), cos.float(), sin.float()))
    apply_rotary_(q, k, cos, sin)
    assert_close_ulps(q, once_q, 1, min_exact=0.99)
    assert_close_ulps(k, once_k, 1, min_exact=0.99)
    assert torch.equal(qkv[:, (Hq + Hkv) * D :], v_before)
