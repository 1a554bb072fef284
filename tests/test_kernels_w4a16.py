"""The weight-only GEMMs (W4A16 int4 groups, W8A16 int8 channels) against matmul with the
dequantized weight (Marlin's oracle), on fresh random inputs: under Triton's interpreter on a CPU
with small shapes, natively on a GPU with Llama-3-8B's linear shapes.

The kernel rounds the dequantized weight to x's dtype where the reference does (int4), or multiplies
the fp32 sum by the channel scale (int8: the same number up to fp32 rounding), and sums in fp32:
what is left is the order of the sums. In fp32 (IEEE dots) that is ~1e-7 relative; in fp16/bf16 it
is the output's rounding, a few 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels import w4a16 as w4a16_module
from minillm.kernels.w4a16 import (
    choose_tiles,
    dequantize_int4,
    pack_int4,
    unpack_int4,
    w4a16_gemm,
    w4a16_gemm_ref,
    w8a16_gemm,
    w8a16_gemm_ref,
)
from minillm.kernels.w4a16_gemv import w4a16_gemv_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
# the GEMV (w4a16_gemv.py) keeps W in fp32: its bound is elementwise (assert_within_rounding)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# relative (Frobenius) error; bf16 is looser because int8's kernel scales the fp32 sum while the
# reference rounds each dequantized weight to bf16 first (2^-9 each): on 7 outputs of K = 33 the two
# differ by up to 7e-3 (H100)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.5e-2}
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


def int4_weight(g, N: int, K: int, group_size: int, dtype=torch.float32):
    """Random packed q, scales ~ a trained layer's (1e-2) and mins below 0, on DEVICE."""
    q = torch.randint(0, 16, (N, K), generator=g)
    scales = (torch.rand(N, K // group_size, generator=g) * 0.02 + 0.002).to(dtype)
    mins = (-torch.rand(N, K // group_size, generator=g) * 0.15).to(dtype)
    return pack_int4(q).to(DEVICE), scales.to(DEVICE), mins.to(DEVICE)


def int8_weight(g, N: int, K: int, dtype=torch.float32):
    q = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    return q.to(DEVICE), (torch.rand(N, generator=g) * 0.01 + 1e-3).to(dtype).to(DEVICE)


def assert_within_rounding(y, x, qweight, scales, mins, group_size: int) -> None:
    """|y - the fp32 product with the fp32-dequantized W| <= what the arithmetic allows, per element.

    The kernel and the reference both sum in fp32, in different orders, terms no larger than
    |x_k| (48 |s| + |m|) (the GEMV's folded form 16 s f + (m - 16 s), f < 2); a sum of n terms errs by
    at most n 2^-24 times the sum of their sizes. Then y is rounded once to its dtype (half an ulp)."""
    ref = w4a16_gemv_ref(x.float(), qweight, scales, mins, group_size)  # [M, N] fp32, unrounded
    K = x.shape[1]
    size = (48 * scales.float().abs() + mins.float().abs()).repeat_interleave(group_size, dim=1)  # [N, K]
    sums = 2 * (K + 16) * 2.0 ** -24 * (x.float().abs() @ size.t())  # both orders' error
    bound = UNIT_ROUNDOFF[y.dtype] * (ref.abs() + sums) + sums
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def test_pack_unpack_round_trip(g):
    q = torch.randint(0, 16, (5, 64), generator=g)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    assert packed[0, 0].item() == q[0, 0].item() | q[0, 1].item() << 4  # low nibble = even k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size,N,K", [(32, 45, 96), (64, 77, 192), (128, 33, 384)])
@pytest.mark.parametrize("M", [1, 3, 16, 33])
def test_w4a16_matches_dequantized_matmul(M, N, K, group_size, dtype, g):
    qweight, scales, mins = int4_weight(g, N, K, group_size, dtype)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    ref = w4a16_gemm_ref(x, qweight, scales, mins, group_size)
    for split_k in (None, 1, 3):  # chosen, none, and a split that leaves a short last slice
        y = w4a16_gemm(x, qweight, scales, mins, group_size, split_k=split_k)
        assert y.dtype == dtype and y.shape == (M, N)
        if split_k is None and M <= w4a16_module.GEMV_M:  # the GEMV: fp32 weights, not rounded to x's dtype
            assert_within_rounding(y, x, qweight, scales, mins, group_size)
        else:
            assert rel_err(y, ref) < TOL[dtype], (split_k, rel_err(y, ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(45, 77), (64, 200), (7, 33)])  # K tails no tile divides
@pytest.mark.parametrize("M", [1, 3, 16, 33])
def test_w8a16_matches_dequantized_matmul(M, N, K, dtype, g):
    qweight, scales = int8_weight(g, N, K, dtype)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    ref = w8a16_gemm_ref(x, qweight, scales)
    for split_k in (None, 1, 2):
        y = w8a16_gemm(x, qweight, scales, split_k=split_k)
        assert y.dtype == dtype and y.shape == (M, N)
        assert rel_err(y, ref) < TOL[dtype], (split_k, rel_err(y, ref))


def test_the_reference_is_the_dequantized_weight(g):
    """The oracle itself: dequantize_int4 reads the layout as documented, element by element."""
    qweight, scales, mins = (t.cpu() for t in int4_weight(g, 3, 64, 32))
    w = dequantize_int4(qweight, scales, mins, 32)
    n, k = 2, 37  # odd k: the high nibble of byte 18, group 1
    q = (qweight[n, k // 2].item() >> 4) & 0xF
    qs, m = q * scales[n, 1].item(), mins[n, 1].item()  # exact in double: fp32 operands, q < 16
    # fp32 rounds twice, q * s and then + m: each rounding errs by at most 2^-24 of its result, so the
    # bound is 2^-24 (|q s| + |q s + m|) (+ 2^-48 terms) -- absolute, since q s + m may cancel to near 0
    bound = 2.0 ** -24 * (abs(qs) + abs(qs + m)) * (1 + 2.0 ** -23)
    assert abs(w[n, k].item() - (qs + m)) <= bound


def test_decode_rows_do_not_depend_on_the_batch(g):
    """Every M <= 16 the tiles run (above GEMV_M, 0 by default) gets the same tiles and split: row i's
    result is the same bits alone or batched (the GEMV's own test checks the same for it)."""
    qweight, scales, mins = int4_weight(g, 40, 128, 32)
    x = torch.randn(16, 128, generator=g).to(DEVICE)
    full = w4a16_gemm(x, qweight, scales, mins, 32)
    for M in sorted({w4a16_module.GEMV_M + 1, 5, 9}):
        assert torch.equal(w4a16_gemm(x[:M].contiguous(), qweight, scales, mins, 32), full[:M])
    for dtype in DTYPES:
        assert choose_tiles(1, 4096, 4096, 128, dtype, torch.device(DEVICE), None) == \
            choose_tiles(16, 4096, 4096, 128, dtype, torch.device(DEVICE), None)


def test_empty_inputs(g):
    qweight, scales, mins = int4_weight(g, 8, 64, 32)
    assert w4a16_gemm(torch.empty(0, 64, device=DEVICE), qweight, scales, mins, 32).shape == (0, 8)


def _bad_int4_calls(g):
    qweight, scales, mins = int4_weight(g, 8, 64, 32)
    x = torch.randn(2, 64, generator=g).to(DEVICE)
    yield (x, qweight.to(torch.int8), scales, mins, 32), TypeError, "qweight of a W4A16 GEMM must be torch.uint8"
    yield (x[:, :32], qweight, scales, mins, 32), ValueError, r"in_features = x.shape\[1\] = 32"
    yield (x, qweight, scales, mins, 128), ValueError, "group_size 128 must divide in_features 64"
    yield (x, qweight, scales, mins, 16), ValueError, "group_size must be a multiple of 32"
    yield (x, qweight, scales, mins, 0), ValueError, "group_size must be a positive int"
    yield (x, qweight, scales[:, :1], mins, 32), ValueError, r"scales must have shape \[8, 2\]"
    yield (x, qweight, scales, mins.half(), 32), ValueError, "mins must match scales"
    yield (x.int(), qweight, scales, mins, 32), TypeError, "x must be float16, bfloat16 or float32"
    yield (x[0], qweight, scales, mins, 32), ValueError, "x must be 2-D"
    yield (x.t().contiguous().t(), qweight, scales, mins, 32), ValueError, "x's last dim must be contiguous"
    yield ("x", qweight, scales, mins, 32), TypeError, "x must be a torch.Tensor"


def test_bad_arguments_are_clear_errors(g):
    for args, exc, match in _bad_int4_calls(g):
        with pytest.raises(exc, match=match):
            w4a16_gemm(*args)
    qweight, scales = int8_weight(g, 8, 40)
    x = torch.randn(2, 40, generator=g).to(DEVICE)
    with pytest.raises(TypeError, match="qweight of a W8A16 GEMM must be torch.int8"):
        w8a16_gemm(x, qweight.to(torch.uint8), scales)
    with pytest.raises(ValueError, match=r"scales must have shape \[8\]"):
        w8a16_gemm(x, qweight, scales[:, None])
    with pytest.raises(ValueError, match="split_k must be None or a positive int"):
        w8a16_gemm(x, qweight, scales, split_k=0)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's bf16 limitation")
def test_interpreter_refuses_bf16(g):
    qweight, scales, mins = int4_weight(g, 8, 64, 32, torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter gets bfloat16 tl.dot wrong"):
        w4a16_gemm(torch.randn(2, 64, dtype=torch.bfloat16), qweight, scales, mins, 32)
    # the reference takes it (it is what runs on a CPU)
    assert w4a16_gemm_ref(torch.randn(2, 64, dtype=torch.bfloat16), qweight, scales, mins, 32).dtype == torch.bfloat16


@needs_cuda
@pytest.mark.parametrize("M", [1, 16, 128, 1024])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])  # Llama-3-8B
def test_llama3_shapes_on_gpu(M, N, K, g):
    for group_size in (32, 128):
        qweight, scales, mins = int4_weight(g, N, K, group_size, torch.bfloat16)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
        y, ref = w4a16_gemm(x, qweight, scales, mins, group_size), w4a16_gemm_ref(x, qweight, scales, mins, group_size)
        assert rel_err(y, ref) < TOL[torch.bfloat16]
    qweight, scales = int8_weight(g, N, K, torch.bfloat16)
    y, ref = w8a16_gemm(x, qweight, scales), w8a16_gemm_ref(x, qweight, scales)
    assert rel_err(y, ref) < TOL[torch.bfloat16]
