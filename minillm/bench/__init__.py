"""`minillm bench NAME` / `python -m minillm.bench NAME`: named workloads, one table each.

Every table starts with this device's measured ceilings and puts minillm next to its peer, run in
the same process, with the ratio (and % of roofline where one applies). Medians over repeats,
warm-up excluded, device events on a GPU.
"""

from __future__ import annotations

WORKLOADS = {
    "ceilings": ("minillm.bench.ceilings", "copy bandwidth, matmul rate, and GEMV vs GEMM across batch sizes"),
    "tokenizer": ("minillm.bench.tokenizer", "encode throughput vs HF tokenizers (single thread)"),
    "attention": ("minillm.bench.attention", "FlashAttention prefill and FlashDecoding vs PyTorch SDPA"),
}


def run(name: str, **kwargs):
    import importlib

    if name not in WORKLOADS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(WORKLOADS)}")
    module = importlib.import_module(WORKLOADS[name][0])
    return module.run(**kwargs)
