"""The fp8 weight-only GEMM (kernels/w8a16_fp8.py): the e4m3 decoding against PyTorch's float8_e4m3fn
for all 256 codes, the GEMM against an fp32 matmul with the dequantized weight, per element within
what the arithmetic allows, on fresh random inputs (Triton's interpreter on a CPU, natively on a GPU),
and a row's result against its batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from minillm.kernels.w4a16 import DECODE_M
from minillm.kernels.w8a16_fp8 import dequantize_fp8, fp8_w8a16_gemm, fp8_w8a16_gemm_ref
from minillm.kernels.wna16_dequant import FP8_BITS, FP8_CVT, dequantize_weight, e4m3_to_f16

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
FP8 = torch.float8_e4m3fn
# the GPU's own conversion (cvt) runs where Triton lowers it: compute capability >= 8.9, or the interpreter
HAS_CVT = INTERPRETED or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))
CVTS = [False] + ([True] if HAS_CVT else [])
DEFAULT_CVT = HAS_CVT and not INTERPRETED  # what fp8_w8a16_gemm chooses (cvt=None)
# (split_k, cvt) per GEMM check: the chosen path, a split K summed afterwards, the other decoding
RUNS = [(None, None), (2, None)] + ([(None, not DEFAULT_CVT)] if HAS_CVT else [])
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs Triton")


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


def fp8_weight(g, N: int, K: int, per_channel: bool = True):
    """Codes of every magnitude (|w| up to 448, subnormals included) and scales ~ a trained layer's.
    Clamped before the cast: torch 2.13 saturates an out-of-range float, torch 2.11 makes it NaN."""
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 2.5, K)[torch.randperm(K, generator=g)]
    w = w.clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8)
    scale = torch.rand(N if per_channel else (), generator=g) * 1e-3 + 1e-4
    return w.to(DEVICE), scale.to(DEVICE)


def assert_within_rounding(y, x, w, scale, weight_rounded: bool = False) -> None:
    """|y - x W^T| per element, W dequantized in fp32, at most what the arithmetic allows.

    Tiles: every product x_k e4m3(q) is exact in fp32 (8 + 4 significant bits), the sum of K of them
    errs by at most K 2^-24 sum|x||W| in any order, the oracle's (q s rounded, then each product) by
    as much again; then y is rounded once to its dtype (half an ulp). weight_rounded: the prefill path
    rounds each dequantized weight to x's dtype first, up to half an ulp of each term (a whole ulp in
    bf16 under the interpreter, whose fp32 -> bf16 cast truncates: NumPy has no bf16)."""
    ref = x.float() @ dequantize_fp8(w, scale).T  # [M, N] fp32
    size = x.float().abs() @ dequantize_fp8(w, scale).abs().T  # sum_k |x_k W_nk|
    sums = 2 * (x.shape[1] + 2) * 2.0 ** -24 * size
    if weight_rounded:
        truncates = INTERPRETED and y.dtype == torch.bfloat16
        sums = sums + UNIT_ROUNDOFF[y.dtype] * (2 if truncates else 1) * size
    bound = UNIT_ROUNDOFF[y.dtype] * (ref.abs() + sums) + sums
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@triton.jit
def _decode(C, Y, BLOCK: tl.constexpr, CVT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, e4m3_to_f16(tl.load(C + offs), CVT).to(tl.float32))


@pytest.mark.parametrize("cvt", CVTS)
def test_every_e4m3_code_decodes_as_torch_does(cvt):
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    want = codes.view(FP8).float()  # PyTorch's conversion: 0x7F and 0xFF are NaN, 0x80 is -0.0
    got = torch.empty(256, device=DEVICE)
    _decode[(1,)](codes, got, BLOCK=256, CVT=cvt)
    # the same float32 bits, except NaN's payload: -0.0 stays -0.0, subnormals (e = 0) stay exact
    nan = want.isnan()
    if not (cvt and INTERPRETED):  # the interpreter's own float8 conversion reads 0x7F as 480 (Triton 3.9)
        assert torch.equal(got.isnan(), nan) and nan.sum() == 2
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    # and through the prefill path's dequantization kernel, scale 1
    w = dequantize_weight(codes[None], torch.ones(1, device=DEVICE), None, 256, 8, torch.float32,
                          fp8=FP8_CVT if cvt else FP8_BITS)[0]
    assert torch.equal(w[~nan].view(torch.int32), got[~nan].view(torch.int32))
    assert torch.equal(w.isnan(), got.isnan())


@pytest.mark.parametrize("cvt", CVTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_code_reaches_the_gemm_exactly(dtype, cvt):
    """x = I picks each weight out on its own: y[m, n] = e4m3(q[n, m]), every finite code, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[~codes.float().isnan()]  # [254]; a NaN weight times 0 would spoil its whole column
    w = torch.cat([codes, codes.new_zeros(2)]).view(16, 16).to(DEVICE)  # [N, K]
    eye = torch.eye(16, dtype=dtype, device=DEVICE)
    y = fp8_w8a16_gemm(eye, w, torch.ones(16, device=DEVICE), cvt=cvt)
    assert torch.equal(y.float(), w.float().T)  # [M = K, N]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(37, 70), (50, 129), (16, 256)])  # tails that no tile divides
@pytest.mark.parametrize("M", [1, 2, 3, 5, 16])
def test_gemm_matches_the_dequantized_matmul(M, N, K, dtype, g):
    for per_channel in (True, False):
        w, scale = fp8_weight(g, N, K, per_channel)
        x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
        for split_k, cvt in RUNS:
            y = fp8_w8a16_gemm(x, w, scale, split_k=split_k, cvt=cvt)
            assert y.dtype == dtype and y.shape == (M, N)
            assert_within_rounding(y, x, w, scale)
        assert_within_rounding(fp8_w8a16_gemm_ref(x, w, scale), x, w, scale, weight_rounded=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_rows_dequantize_then_multiply(dtype, g):
    w, scale = fp8_weight(g, 37, 70)
    x = torch.randn(DECODE_M + 7, 70, generator=g).to(dtype).to(DEVICE)
    y = fp8_w8a16_gemm(x, w, scale)
    assert_within_rounding(y, x, w, scale, weight_rounded=True)
    if not (INTERPRETED and dtype == torch.bfloat16):  # the same rounded weight, the same matmul
        assert torch.equal(y, fp8_w8a16_gemm_ref(x, w, scale))


def test_a_row_does_not_depend_on_its_batch(g):
    """Every M <= DECODE_M gets the same tiles and split: row 0's bits alone, batched, and beside other rows."""
    w, scale = fp8_weight(g, 40, 300)
    x = torch.randn(DECODE_M, 300, generator=g).half().to(DEVICE)
    full = fp8_w8a16_gemm(x, w, scale)
    for M in (1, 2, 3, 5, 9):
        assert torch.equal(fp8_w8a16_gemm(x[:M].contiguous(), w, scale), full[:M])
    other = torch.cat([x[:1], torch.randn(4, 300, generator=g).half().to(DEVICE)])
    assert torch.equal(fp8_w8a16_gemm(other, w, scale)[0], full[0])


def test_bad_arguments_are_clear_errors(g):
    w, scale = fp8_weight(g, 8, 32)
    x = torch.randn(2, 32, generator=g).half().to(DEVICE)
    for fn in (fp8_w8a16_gemm, fp8_w8a16_gemm_ref):
        with pytest.raises(TypeError, match="weight of an fp8 weight-only GEMM must be torch.float8_e4m3fn"):
            fn(x, w.view(torch.uint8), scale)
        with pytest.raises(ValueError, match=r"in_features = x.shape\[1\] = 16"):
            fn(x[:, :16], w, scale)
        with pytest.raises(ValueError, match=r"weight_scale must be float32 of shape \[8\]"):
            fn(x, w, scale.half())
        with pytest.raises(ValueError, match=r"weight_scale must be float32 of shape \[8\]"):
            fn(x, w, scale[:4])
    assert fp8_w8a16_gemm(x[:0], w, scale).shape == (0, 8)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 16, 128])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336)])  # Llama-3-8B's qkv and down projections
def test_llama3_shapes_on_gpu(M, N, K, g):
    w, scale = fp8_weight(g, N, K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    assert_within_rounding(fp8_w8a16_gemm(x, w, scale), x, w, scale, weight_rounded=M > DECODE_M)
