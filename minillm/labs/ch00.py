"""Checks for lab 00: the arithmetic of inference (FLOPs, bytes, the roofline, the KV cache)."""

from __future__ import annotations

import random

from ..hw import Ceilings, matmul_cost
from ..kv_memory import kv_cache_bytes
from .checker import check


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
