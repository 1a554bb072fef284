"""Chapter 18's split-K decode GEMV against the unfused ops in plain PyTorch (RMSNorm, F.linear,
SiLU-and-mul, the residual add), on fresh random inputs: every variant, M = 1..8, N and K that leave
tails, one K tile and several; a row's result independent of M (the fixed reduction order); the
counters left at zero; bad input refused."""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels import gemv as gemv_mod
from minillm.kernels.gemv import MAX_M, gemv, gemv_config, gemv_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
# bf16 under the interpreter truncates (numpy has no bf16); the GPU run covers it
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
PDL = not INTERPRETED and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
SMALL = (8, 64, 4)  # (BLOCK_N, BLOCK_K, warps): small tiles, so small shapes still split K


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _inputs(g, M, N, K, dtype, norm, res, bias, silu):
    x = _rand(g, M, K, dtype=dtype)
    w = _rand(g, N, K, dtype=dtype, scale=K**-0.5)
    n_out = N // 2 if silu else N
    return x, w, dict(norm_weight=_rand(g, K, dtype=dtype) if norm else None,
                      residual=_rand(g, M, n_out, dtype=dtype) if res else None,
                      bias=_rand(g, N, dtype=dtype) if bias else None, silu_mul=silu)


def _close(out, x, w, kw, dtype):
    # the oracle in fp32 on the same (rounded) inputs; ours rounds at the unfused ops' places, and its
    # sums run in another order: a few ulps of the dtype at the output's magnitude
    ref = gemv_ref(x.float(), w.float(), **{k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()})
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref, rtol=4 * eps, atol=8 * eps * ref.abs().max().item() + 1e-5)


@pytest.mark.parametrize("norm,res,bias,silu", [
    (False, False, False, False), (True, False, False, False), (False, True, False, False),
    (True, False, True, True), (False, True, True, False), (True, True, True, True),
])
@pytest.mark.parametrize("M,N,K,config", [
    (1, 40, 200, SMALL),  # 4 K tiles, the last 8 wide; 5 column tiles
    (3, 38, 64, SMALL),  # one K tile: no workspace, no counter
    (MAX_M, 66, 131, SMALL),  # tails everywhere
    (5, 70, 300, None),  # gemv_config's tiles
])
def test_matches_the_unfused_ops(seed, norm, res, bias, silu, M, N, K, config, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, w, kw = _inputs(g, M, N, K, dtype, norm, res, bias, silu)
    out = gemv(x, w, **kw, eps=1e-5, config=config, pdl=PDL)
    kw["eps"] = 1e-5
    assert out.shape == (M, N // 2 if silu else N) and out.dtype == dtype
    _close(out, x, w, kw, dtype)
    assert not gemv_mod._counter(x.device).any(), "a launch left a counter set: the next one would miscount"


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("silu", [False, True])
def test_half_precision(seed, dtype, silu):
    test_matches_the_unfused_ops(seed, True, True, True, silu, MAX_M, 66, 131, SMALL, dtype)


@pytest.mark.parametrize("M", range(1, MAX_M + 1))
def test_every_row_count(seed, M):
    g = torch.Generator().manual_seed(seed)
    x, w, kw = _inputs(g, M, 24, 150, torch.float32, True, True, False, False)
    _close(gemv(x, w, **kw, config=SMALL, pdl=PDL), x, w, kw, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_batch(seed, dtype):
    """The reduction order is M's business nowhere: a sequence decodes bitwise the same alone as in a
    batch of 8 (the engine's batched = alone oracle, at the kernel)."""
    g = torch.Generator().manual_seed(seed)
    x, w, kw = _inputs(g, MAX_M, 2 * 36, 200, dtype, True, True, False, True)
    batched = gemv(x, w, **kw, config=SMALL, pdl=PDL)
    for m in (0, 3, MAX_M - 1):
        one = {**kw, "residual": kw["residual"][m:m + 1]}
        alone = gemv(x[m:m + 1], w, **one, config=SMALL, pdl=PDL)
        assert torch.equal(alone[0], batched[m])


def test_config_depends_on_the_shape_only():
    # small shapes spread over >= 4 programs per SM; the choice never sees M
    for N, K, silu in ((960, 576, False), (3072, 576, True), (4096, 14336, False), (128256, 2048, False)):
        block_n, block_k, warps = gemv_config(N, K, silu)
        n_out = N // 2 if silu else N
        programs = -(-n_out // block_n) * -(-K // block_k)
        assert block_k in (256, 512) and block_n in (4, 8, 16, 32) and warps == 4
        assert programs >= 4 * gemv_mod.NUM_SMS or block_n == 4


def test_bad_input_is_refused():
    x, w = torch.randn(2, 16, device=DEVICE), torch.randn(10, 16, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        gemv(torch.randn(MAX_M + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must be"):
        gemv(x, torch.randn(10, 17, device=DEVICE))
    with pytest.raises(ValueError, match="even N"):
        gemv(x, torch.randn(9, 16, device=DEVICE), silu_mul=True)
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=torch.randn(2, 9, device=DEVICE))
    with pytest.raises(TypeError, match="x must be"):
        gemv(x.long(), w)


@pytest.mark.skipif(not PDL, reason="needs a Hopper GPU (programmatic dependent launch)")
def test_pdl_chain_in_a_cuda_graph_gpu(seed):
    """32 GEMVs, each reading the one before (norm prologue, residual epilogue), captured in one CUDA
    graph: launched with PDL they give bitwise what they give without. A gdc_wait after a read of x, or
    a counter touched before the previous launch ended, would show as a different result."""
    g = torch.Generator().manual_seed(seed)
    K = 1024
    ws = [_rand(g, K, K, dtype=torch.bfloat16, scale=K**-0.5) for _ in range(32)]
    gain, x0 = _rand(g, K, dtype=torch.bfloat16), _rand(g, 4, K, dtype=torch.bfloat16)
    results = {}
    for pdl in (False, True):
        h = x0.clone()

        def chain(h=h, pdl=pdl):
            y = h
            for w in ws:
                y = gemv(y, w, norm_weight=gain, residual=y, pdl=pdl)
            h.copy_(y)
        chain()  # compile and allocate outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        outs = []
        for _ in range(3):
            h.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            outs.append(h.clone())
        results[pdl] = outs
    assert all(torch.equal(o, results[False][0]) for o in results[False] + results[True])
