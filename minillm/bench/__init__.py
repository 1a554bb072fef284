"""`minillm bench NAME` / `python -m minillm.bench NAME`: named workloads, one table each.

Every table starts with this device's measured ceilings and puts minillm next to its peer, run in
the same process, with the ratio (and % of roofline where one applies). Medians over repeats,
warm-up excluded, device events on a GPU.

A workload is "module" (its `run` function) or "module:function". A module with
`add_arguments(parser, name)` takes command-line options (`minillm bench throughput --help`); they
reach the function as keyword arguments.
"""

from __future__ import annotations

WORKLOADS = {
    "ceilings": ("minillm.bench.ceilings", "copy bandwidth, matmul rate, and GEMV vs GEMM across batch sizes"),
    "tokenizer": ("minillm.bench.tokenizer", "encode throughput vs HF tokenizers (single thread)"),
    "attention": ("minillm.bench.attention", "FlashAttention prefill and FlashDecoding vs PyTorch SDPA"),
    "moe": ("minillm.bench.moe", "fused MoE vs per-expert loop vs dense GEMMs, routing skew, paged MLA decode GB/s"),
    "throughput": ("minillm.bench.serving:throughput",
                   "256 random requests through the engine vs HF generate with static batches"),
    "latency": ("minillm.bench.serving:latency", "batch 1, 128-token prompt, 256 new tokens vs HF generate, "
                "% of the weight-reading floor"),
    "profile": ("minillm.bench.profile", "one decode step per batch size, overlap scheduling on and off: wall vs "
                "GPU kernel time, kernels per step and per layer, host phases, top kernels (chapter 13)"),
    "spec": ("minillm.bench.spec", "speculative decoding: each proposer vs plain decoding, acceptance, step costs, "
             "predicted vs measured speedup (chapter 09)"),
    "structured": ("minillm.bench.structured", "structured output: compile ms and mask us/token, ours vs xgrammar; "
                   "constrained vs free decode tok/s; validity (chapter 14)"),
    "kv": ("minillm.bench.kv", "KV eviction: each policy vs the full cache: blocks held, greedy agreement, NLL, passkey, "
           "decode tok/s (chapter 15)"),
    "lora": ("minillm.bench.lora", "multi-LoRA: prefill/decode tok/s with 0, 1, 4, 16 distinct adapters in a batch vs the "
             "base model and HF + PEFT; greedy parity with PEFT (chapter 16)"),
    "disagg": ("minillm.bench.disagg", "colocated vs 1 prefill + 1 decode engine: TTFT/TPOT/ITL p50/p99 and goodput "
               "at 6-8 Poisson rates, ITL p99 in a prefill burst, tokens equal (chapter 17)"),
    "serve": ("minillm.bench.serve", "load an OpenAI-compatible server (--base-url): TTFT/TPOT/ITL/E2E percentiles, "
              "throughput, goodput"),
}


def _resolve(name: str):
    import importlib

    if name not in WORKLOADS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(WORKLOADS)}")
    module_name, _, func = WORKLOADS[name][0].partition(":")
    module = importlib.import_module(module_name)
    return module, getattr(module, func or "run")


def run(name: str, **kwargs):
    return _resolve(name)[1](**kwargs)


def main(name: str, argv: list[str] | None = None):
    """Run a workload with command-line options (what `minillm bench NAME ...` calls)."""
    import argparse

    module, fn = _resolve(name)
    parser = argparse.ArgumentParser(prog=f"minillm bench {name}", description=WORKLOADS[name][1])
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser, name)
    args = parser.parse_args(argv or [])
    return fn(**vars(args))
