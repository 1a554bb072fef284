"""Benchmark: this device's ceilings, and GEMV vs GEMM on one weight matrix (chapter 00)."""

from __future__ import annotations

from ..hw import ceilings, ceilings_dtype, default_device, gemm_sweep
from .table import print_table

# Llama-3-8B's MLP up-projection, hidden 4096 -> 14336: a real decode-time weight (117 MB in bf16).
GPU_SHAPE, CPU_SHAPE = (14336, 4096), (2048, 1024)
GPU_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
CPU_BATCHES = [1, 4, 16, 64, 256]


def run(device=None, batches=None) -> dict:
    device = default_device() if device is None else device
    ceil = ceilings(device)
    print_table([ceil.as_dict()], title="measured ceilings")
    gpu = device.type == "cuda"
    n, k = GPU_SHAPE if gpu else CPU_SHAPE
    rows = gemm_sweep(device, n, k, batches or (GPU_BATCHES if gpu else CPU_BATCHES), ceilings_dtype(device))
    for r in rows:
        roof = ceil.attainable_tflops(r["intensity"])
        r["roofline_tflops"] = roof
        r["pct_of_roofline"] = 100 * r["tflops"] / roof
        r["us"] = r["seconds"] * 1e6
        r["time_vs_batch1"] = r["seconds"] / rows[0]["seconds"]
    print()
    print_table(rows, ["batch", "us", "time_vs_batch1", "intensity", "tflops", "gbps", "roofline_tflops",
                       "pct_of_roofline"], title=f"linear: X[batch, {k}] @ W[{n}, {k}]^T ({ceil.dtype}) on {ceil.device}")
    return {"ceilings": ceil, "sweep": rows, "shape": (n, k)}
