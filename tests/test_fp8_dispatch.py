"""Which GEMM fp8 mode runs (layers/quantization/fp8.py): weight-only up to WEIGHT_ONLY_MAX_M rows, W8A8
above it where the device has an FP8 GEMM (or emulate=True asks for the references), weight-only at
every M where it has none. The GEMMs are replaced by spies, so every branch is checked on any device.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minillm.layers.quantization import Fp8Config
from minillm.layers.quantization import fp8 as fp8_module
from minillm.layers.quantization.fp8 import WEIGHT_ONLY_MAX_M, Fp8LinearMethod, quantize_weight_fp8

N, K = 32, 48
GEMMS = ("fp8_w8a16_gemm", "fp8_w8a16_gemm_ref", "fp8_gemm", "fp8_gemm_ref")
QUANTS = ("scaled_fp8_quant", "scaled_fp8_quant_ref")


@pytest.fixture
def calls(monkeypatch):
    """Each GEMM and activation quantization in fp8.py replaced by a spy that records its name."""
    seen = []

    def spy(name):
        def fn(*args, **kwargs):
            seen.append(name)
            if name in QUANTS:  # (q_x, s_x): what the W8A8 GEMM takes next
                return args[0].to(torch.float8_e4m3fn), torch.ones(args[0].shape[0], 1)
            return torch.zeros(args[0].shape[0], N)  # [M, N]
        return fn

    for name in GEMMS + QUANTS:
        monkeypatch.setattr(fp8_module, name, spy(name))
    return seen


def run(M: int, *, emulate: bool, triton: bool) -> None:
    q, s = quantize_weight_fp8(torch.randn(N, K))
    layer = SimpleNamespace(weight=q, weight_scale=s)
    y = Fp8LinearMethod(Fp8Config(emulate=emulate)).matmul(layer, torch.randn(M, K), triton)
    assert y.shape == (M, N)


@pytest.mark.parametrize("triton", [True, False])
def test_small_m_is_weight_only_and_large_m_is_w8a8_on_fp8_hardware(calls, monkeypatch, triton):
    monkeypatch.setattr(fp8_module, "has_fp8_gemm", lambda device: True)
    for M in (1, 2, WEIGHT_ONLY_MAX_M):
        run(M, emulate=False, triton=triton)
        assert calls == ["fp8_w8a16_gemm" if triton else "fp8_w8a16_gemm_ref"], M
        calls.clear()
    for M in (WEIGHT_ONLY_MAX_M + 1, 4096):
        run(M, emulate=False, triton=triton)
        assert calls == ["scaled_fp8_quant", "fp8_gemm"], M  # today's W8A8: minillm's quantize + _scaled_mm
        calls.clear()


@pytest.mark.parametrize("has_fp8", [True, False])
def test_emulate_runs_the_references_of_both_paths(calls, monkeypatch, has_fp8):
    monkeypatch.setattr(fp8_module, "has_fp8_gemm", lambda device: has_fp8)
    run(WEIGHT_ONLY_MAX_M, emulate=True, triton=True)
    assert calls == ["fp8_w8a16_gemm_ref"]
    calls.clear()
    run(WEIGHT_ONLY_MAX_M + 1, emulate=True, triton=True)
    assert calls == ["scaled_fp8_quant_ref", "fp8_gemm_ref"]


@pytest.mark.parametrize("triton", [True, False])
def test_without_fp8_hardware_every_m_is_weight_only(calls, monkeypatch, triton):
    monkeypatch.setattr(fp8_module, "has_fp8_gemm", lambda device: False)
    for M in (1, WEIGHT_ONLY_MAX_M, WEIGHT_ONLY_MAX_M + 1, 4096):  # above DECODE_M: dequantize, then matmul
        run(M, emulate=False, triton=triton)
        assert calls == ["fp8_w8a16_gemm" if triton else "fp8_w8a16_gemm_ref"], M
        calls.clear()


def test_the_threshold_is_the_module_constant(calls, monkeypatch):
    monkeypatch.setattr(fp8_module, "has_fp8_gemm", lambda device: True)
    monkeypatch.setattr(fp8_module, "WEIGHT_ONLY_MAX_M", 3)
    run(3, emulate=False, triton=True)
    run(4, emulate=False, triton=True)
    assert calls == ["fp8_w8a16_gemm", "scaled_fp8_quant", "fp8_gemm"]


def test_fp8_hardware_is_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    assert not fp8_module.has_fp8_gemm.__wrapped__(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    assert fp8_module.has_fp8_gemm.__wrapped__(torch.device("cuda")) == hasattr(torch, "_scaled_mm")
    assert not fp8_module.has_fp8_gemm.__wrapped__(torch.device("cpu"))


def test_without_fp8_hardware_quantizing_warns_instead_of_refusing(caplog):
    fp8_module.warn_weight_only.cache_clear()  # once per device: forget earlier tests' warnings
    method = Fp8LinearMethod(Fp8Config())
    with caplog.at_level("WARNING", logger=fp8_module.__name__):
        tensors = method.quantize(torch.randn(N, 40))  # 40: no 16-alignment needed without _scaled_mm
    assert tensors["weight"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (N,)
    assert "weight-only" in caplog.text and "no FP8 matrix units" in caplog.text
