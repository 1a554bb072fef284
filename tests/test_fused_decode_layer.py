"""A decode layer of the Llama family through the fused kernels (chapter 13): what it launches, counted
from the code, and what it computes, against the PyTorch path.

On a CPU the Triton kernels run under the interpreter and the count is of launches (Triton's, and the
aten ops that would each be a GPU kernel); on a GPU it is of the CUDA kernels one replay of the
graphed step runs. Per layer = the difference between two depths, so the step's own work (embedding,
cos/sin lookup, final norm, lm_head) cancels.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch
from kernel_count import cpu_launches, decode_step, gpu_kernels, per_layer, preset_model
from tiny_models import random_model

import minillm.kernels.flash_decode as flash_decode_kernels
import minillm.layers.attention as attention
import minillm.layers.layernorm as layernorm
from minillm.layers.backend import kernel_mode

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")

# One decode layer, fused: residual add + RMSNorm + QKV projection; RoPE + KV write (+ QK-norm);
# FlashDecoding with its merge in the kernel; o_proj; residual add + RMSNorm + gate_up + SiLU-and-mul;
# down_proj.
FUSED_LAYER = Counter({"triton._skinny_gemm_kernel": 2, "triton._rope_store_kv_kernel": 1,
                       "triton._flash_decode_split": 1, "aten.linear": 2})
# ... without the skinny GEMM (MINILLM_SKINNY_GEMM=0): the norms, SiLU-and-mul and cuBLAS GEMMs apart.
NO_SKINNY_LAYER = Counter({"triton._rms_norm_kernel": 2, "aten.linear": 4, "triton._rope_store_kv_kernel": 1,
                           "triton._flash_decode_split": 1, "triton._silu_and_mul_kernel": 1})


def _model(arch: str, layers: int, seed: int):
    model, _ = random_model(random.Random(seed), architecture=arch, num_layers=layers, sliding_windows=[],
                            qk_norm=arch == "qwen3")
    return model


def _unfused(monkeypatch) -> None:
    """The pre-chapter-13 layer: rotary + store_kv (+ two QK-norms), and the separate combine kernel."""
    monkeypatch.setattr(layernorm, "_skinny_on", False)
    monkeypatch.setattr(attention, "fusable", lambda *a: False)
    split = flash_decode_kernels.flash_decode
    monkeypatch.setattr(flash_decode_kernels, "flash_decode", lambda *a, **kw: split(*a, **kw, fused_combine=False))


def _launches_per_layer(arch: str, seed: int) -> tuple[float, Counter]:
    counts = {}
    for layers in (2, 3):
        # batch 2 (one padding row) over 48-key tables: the interpreter's 4 "SMs" want several splits
        step = decode_step(_model(arch, layers, seed), batch=2, context=48, pad=1, seed=seed)
        with kernel_mode("triton"):
            with torch.inference_mode():
                step()  # the first call builds the cos/sin table and the split counters
            counts[layers] = cpu_launches(step)
    return per_layer(counts[2], counts[3], 2, 3), counts[3] - counts[2]


@pytest.mark.skipif(not INTERPRETED, reason="counts the interpreter's launches (the GPU test counts kernels)")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.slow
def test_kernels_per_decode_layer(seed, arch, monkeypatch):
    monkeypatch.setattr(layernorm, "_skinny_on", True)  # whatever MINILLM_SKINNY_GEMM says
    n, which = _launches_per_layer(arch, seed)
    print(f"{arch}: {n:g} launches per decode layer, fused: {dict(which)}")
    assert which == FUSED_LAYER and n == 6


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETED, reason="counts the interpreter's launches (the GPU test counts kernels)")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kernels_per_decode_layer_before_the_fusions(seed, arch, monkeypatch):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layernorm, "_skinny_on", False)
        n, which = _launches_per_layer(arch, seed)
    print(f"{arch}: {n:g} launches per decode layer, without the skinny GEMM: {dict(which)}")
    assert which == NO_SKINNY_LAYER and n == 9
    _unfused(monkeypatch)
    before, which = _launches_per_layer(arch, seed)
    print(f"{arch}: {before:g} launches per decode layer, unfused: {dict(which)}")
    assert before == (13 if arch == "qwen3" else 11)  # + combine, rotary and store_kv apart (+ 2 QK-norms)


@pytest.mark.parametrize("skinny", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_decode_step_matches_the_pytorch_path(seed, arch, skinny, monkeypatch):
    """Logits of a decode step with a padding row: Triton (rope_store_kv, merge in the kernel, with or
    without the skinny GEMM) vs the PyTorch references, fp32; and the cache rows the step wrote."""
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or a GPU")
    monkeypatch.setattr(layernorm, "_skinny_on", skinny)
    model = _model(arch, 2, seed)
    if not INTERPRETED:
        model = model.cuda()
    step = decode_step(model, batch=3, context=40, pad=1, seed=seed)
    caches = [m.kv_cache for m in model.modules() if isinstance(m, attention.Attention)]
    calls = Counter()
    fused = attention.rope_store_kv

    def counted(*a, **kw):
        calls["rope_store_kv"] += 1
        return fused(*a, **kw)

    out = {}
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "rope_store_kv", counted)
        for mode in ("torch", "triton"):
            with kernel_mode(mode):
                out[mode] = step()[1:]  # row 0 is padding: its logits are never read
            out[mode + " cache"] = [c.clone() for kv in caches for c in kv]
    assert calls["rope_store_kv"] == 2  # one per layer, on the Triton path only
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-4, atol=1e-4)
    for got, want in zip(out["triton cache"], out["torch cache"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("skinny", [False, True])
@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-0.6b"])
def test_kernels_per_graphed_decode_layer_gpu(preset, skinny, monkeypatch):
    """The real shapes, dummy weights, bf16, batch 1: CUDA kernels per layer in one graph replay. The
    Triton kernels are exactly the fused layer's; each cuBLAS GEMM may be one or two kernels (a split-K
    reduction), so the total is bounded, and printed."""
    monkeypatch.setattr(layernorm, "_skinny_on", skinny)
    counts = {}
    for layers in (2, 4):
        counts[layers] = gpu_kernels(decode_step(preset_model(preset, layers), batch=1, context=4096))
    n = per_layer(counts[2], counts[4], 2, 4)
    layer = Counter({k: v // 2 for k, v in (counts[4] - counts[2]).items()})
    print(f"{preset} skinny={skinny}: {n:g} CUDA kernels per graphed decode layer; {dict(layer)}")
    want = FUSED_LAYER if skinny else NO_SKINNY_LAYER
    triton_kernels = Counter({k.removeprefix("triton."): v for k, v in want.items() if k.startswith("triton.")})
    assert Counter({k: v for k, v in layer.items() if k in triton_kernels}) == triton_kernels
    gemms = want["aten.linear"]
    assert sum(triton_kernels.values()) + gemms <= n <= sum(triton_kernels.values()) + 2 * gemms


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("skinny", [False, True])
@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-0.6b"])
def test_graphed_fused_step_matches_the_pytorch_path_gpu(preset, skinny, monkeypatch):
    """The real shapes (2 layers, dummy weights, fp32), batch 4 with a padding row over 4096-key tables
    (FlashDecoding splits, merged in-kernel): one CUDA-graph replay of the fused step gives the PyTorch
    path's logits."""
    monkeypatch.setattr(layernorm, "_skinny_on", skinny)
    model = preset_model(preset, 2, torch.float32)
    step = decode_step(model, batch=4, context=4096, pad=1, seed=3)
    with torch.inference_mode():
        with kernel_mode("torch"):
            want = step()[1:]
        step()  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step()
        for _ in range(2):  # twice: the split counters were reset by the first replay
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(got[1:], want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
