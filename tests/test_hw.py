"""Chapter 00: the KV-cache formula against the published figures, and the roofline arithmetic."""

from __future__ import annotations

import random

import pytest
import torch

from minillm import hw
from minillm.kv_memory import MODELS, GiB, kv_bytes_per_token, kv_cache_bytes, max_batch, model_kv_bytes


def test_kv_formula_matches_the_seed_figures():
    # 70B-class, 80 layers, 8 KV heads, d=128, fp16: 327,680 bytes per token (source 001)
    assert kv_bytes_per_token(80, 8, 128, 2) == 327_680
    # Llama 3 70B: 1.25 GB at 4K, 40 GB at 128K; Llama 3 8B: 0.50 GB and 16 GB (source 003, in GiB)
    assert model_kv_bytes("Llama-3-70B", 4096) / GiB == 1.25
    assert model_kv_bytes("Llama-3.1-70B", 131072) / GiB == 40
    assert model_kv_bytes("Llama-3-8B", 4096) / GiB == 0.5
    assert model_kv_bytes("Llama-3.1-8B", 131072) / GiB == 16
    # 43 GB (decimal) for one 128K sequence of the 70B model (source 001)
    assert round(model_kv_bytes("Llama-3.1-70B", 131072) / 1e9) == 43
    # per token per layer, d=128, fp16: MHA-128 64 KB, MQA 0.5 KB, GQA-8 4 KB (source 004)
    assert kv_bytes_per_token(1, 128, 128, 2) == 64 * 1024
    assert kv_bytes_per_token(1, 1, 128, 2) == 512
    assert kv_bytes_per_token(1, 8, 128, 2) == 4 * 1024


def test_smollm2_kv_per_token():
    s = MODELS["SmolLM2-135M"]
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (30, 3, 64)
    assert model_kv_bytes("SmolLM2-135M", 1) == 2 * 30 * 3 * 64 * 2 == 23_040


def test_kv_scales_linearly(seed):
    rng = random.Random(seed)
    for _ in range(50):
        args = (rng.randint(1, 100), rng.randint(1, 16), rng.choice([64, 128]))
        t, b = rng.randint(1, 10_000), rng.randint(1, 64)
        assert kv_cache_bytes(*args, seq_len=t, batch=b) == b * t * kv_cache_bytes(*args, seq_len=1)


def test_max_batch():
    per_seq = model_kv_bytes("Llama-3-8B", 8192)  # 1 GiB
    assert max_batch("Llama-3-8B", 8192, 10.5 * per_seq) == 10


@pytest.mark.parametrize("bad", [dict(num_layers=-1), dict(seq_len=1.5), dict(batch="8"), dict(head_dim=True)])
def test_kv_rejects_bad_input(bad):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, seq_len=10, batch=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        kv_cache_bytes(**args)
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_kv_bytes("SmolLM2-135M", 10, dtype="fp12")
    with pytest.raises(ValueError, match="unknown model 'Llama-9B'"):
        model_kv_bytes("Llama-9B", 10)
    with pytest.raises(ValueError, match="dtype_bytes must be a positive number"):
        kv_cache_bytes(2, 2, 64, 10, 1, dtype_bytes="2")
    with pytest.raises(ValueError, match="free_bytes must be >= 0"):
        max_batch("Llama-3-8B", 10, -1)


def test_matmul_flops_match_torch_flop_counter(seed):
    """An independent oracle for the FLOP count: PyTorch's own FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    rng = random.Random(seed)
    for _ in range(5):
        m, n, k = rng.randint(1, 64), rng.randint(1, 64), rng.randint(1, 64)
        a, b = torch.randn(m, k), torch.randn(k, n)
        with FlopCounterMode(display=False) as counter:
            a @ b
        assert hw.matmul_cost(m, n, k)[0] == counter.get_total_flops()
    assert hw.matmul_cost(2, 3, 4, dtype_bytes=2)[1] == (2 * 4 + 4 * 3 + 2 * 3) * 2


def test_roofline_arithmetic():
    c = hw.Ceilings("test", copy_gbps=3000.0, matmul_tflops=750.0, dtype="bf16")
    assert c.ridge == pytest.approx(250.0)
    assert c.attainable_tflops(1.0) == pytest.approx(3.0)  # 1 FLOP/B at 3 TB/s
    assert c.attainable_tflops(1e4) == 750.0
    assert c.attainable_tflops(c.ridge) == pytest.approx(750.0)
    # a GEMV on a 4096x4096 bf16 matrix: 32 MiB of weights at 3 TB/s is ~11 us, far above 2*16M FLOP/750T
    flops, nbytes = hw.matmul_cost(1, 4096, 4096, 2)
    assert c.floor_seconds(flops, nbytes) == pytest.approx(nbytes / 3e12)


def test_measurements_run_on_this_device():
    dev = torch.device("cpu")
    assert hw.measure_copy_gbps(dev, 1 << 20) > 0.1
    assert hw.measure_matmul_tflops(dev, 128, torch.float32) > 1e-5
    rows = hw.gemm_sweep(dev, 256, 128, [1, 8], torch.float32)
    assert [r["batch"] for r in rows] == [1, 8]
    assert rows[1]["intensity"] > rows[0]["intensity"]
    c = hw.ceilings("cpu")
    assert c is hw.ceilings("cpu")  # measured once per process
    assert c.copy_gbps > 0 and c.matmul_tflops > 0 and c.dtype == "float32"


def test_time_it_takes_the_median_per_call():
    calls = []
    seconds = hw.time_it(lambda: calls.append(1), warmup=2, reps=5, inner=3)
    assert len(calls) == 2 + 5 * 3 and seconds >= 0
    import time

    assert 0.004 < hw.time_it(lambda: time.sleep(0.005), warmup=1, reps=3) < 0.05
