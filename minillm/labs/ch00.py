"""Checks for lab 00: the arithmetic of inference (FLOPs, bytes, the roofline, the KV cache)."""

from __future__ import annotations

import random

from ..hw import Ceilings, matmul_cost
from ..kv_memory import kv_cache_bytes
from .checker import check
from .hints import Hints


def check_matmul_cost(fn, cases: int = 200):
    """fn(m, n, k, dtype_bytes) -> (flops, bytes) of C[m,n] = A[m,k] @ B[k,n]."""

    def case(rng: random.Random):
        return rng.randint(1, 8192), rng.randint(1, 16384), rng.randint(1, 16384), rng.choice([1, 2, 4])

    return check("matmul_cost", fn, matmul_cost, case, cases=cases)


def check_kv_cache_bytes(fn, cases: int = 200):
    """fn(num_layers, num_kv_heads, head_dim, seq_len, batch, dtype_bytes) -> bytes of K and V."""

    def case(rng: random.Random):
        return (rng.randint(1, 128), rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([64, 96, 128, 256]),
                rng.randint(1, 1 << 17), rng.randint(1, 256), rng.choice([1, 2, 4]))

    return check("kv_cache_bytes", fn, kv_cache_bytes, case, cases=cases)


def check_attainable(fn, cases: int = 200):
    """fn(intensity, peak_tflops, bandwidth_gbps) -> attainable TFLOP/s under the roofline."""

    def reference(intensity, peak, bw):
        return Ceilings("lab", bw, peak, "bf16").attainable_tflops(intensity)

    def case(rng: random.Random):
        return 10 ** rng.uniform(-1, 4), rng.uniform(10, 2000), rng.uniform(100, 8000)

    return check("attainable_tflops", fn, reference, case, cases=cases)


hint = Hints("00", {
    "matmul_cost": (
        'Count a multiply and an add as two FLOPs, and count every matrix once in bytes.',
        'Each of the m·n outputs is a dot product of length k. The bytes are A, B and C read or written once: m·k + k·n + m·n elements.',
        'flops = 2 * m * n * k\nnbytes = (m * k + k * n + m * n) * dtype_bytes',
    ),
    "kv_cache_bytes": (
        'Every layer caches a key and a value vector per KV head for every token of every sequence.',
        'Per token per layer: 2 (K and V) × num_kv_heads × head_dim elements. Multiply by layers, tokens, batch, bytes.',
        'return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * seq_len * batch',
    ),
    "attainable_tflops": (
        'Below the ridge point memory limits the speed; above it the arithmetic does.',
        'Memory allows intensity (FLOP/byte) × bandwidth (bytes/s) FLOP/s; the roofline is the smaller of that and the peak. Mind the units: GB/s × FLOP/B = GFLOP/s.',
        'return min(peak_tflops, intensity * bandwidth_gbps / 1e3)',
    ),
})
