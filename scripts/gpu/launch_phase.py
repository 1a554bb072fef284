"""Why a batch-256 decode step's `launch` phase takes longer with overlap scheduling on (chapter 13).

`bench profile` at 32-token prompts (chapters/bench/h200-2026-11-26-fastpath/) put the phase at 1.05-1.26 ms
a step with overlap on and 0.66-1.04 ms with it off (three runs). The phase is `executor.execute_model`: the block table's
update and gather, the host tensors and their copies into the graph's buffers (`StepGraphs._fill`), the
scatter of the previous step's tokens, and the graph replay. This script times each part per step (host wall
time, no synchronisation added), overlap on and off, and repeats the pair with the copies staged through
pinned host buffers (the hypothesis: a copy from pageable memory waits for a staging buffer that the
step in flight still holds). Run with minillm installed:

    python3 scripts/gpu/launch_phase.py OUT_DIR      (B=256 PROMPT=32 STEPS=40; DEV=cpu B=4 checks it off a GPU)

-> OUT_DIR/launch_phase.json and a table on stdout.
"""
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

from minillm.bench.serving import _engine, _engine_config
from minillm.bench.serving_setup import load_models
from minillm.sampling import SamplingParams
from minillm.worker import cuda_graphs

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
DEV = torch.device(os.environ.get("DEV", "cuda"))
B, PROMPT, STEPS = (int(os.environ.get(k, d)) for k, d in (("B", "256"), ("PROMPT", "32"), ("STEPS", "40")))


def timed(spent: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.setdefault(key, []).append(time.perf_counter() - t0)
    return wrapper


def pinned_fill(original):
    """StepGraphs._fill with its three host tensors copied into pinned buffers first (two sets, taking turns,
    so the host never rewrites a buffer whose copy the step in flight may not have made yet)."""
    state = {"turn": 0, "bufs": {}}

    def fill(self, shape, *args, **kwargs):
        real_copy = torch.Tensor.copy_

        def staged(dst, src, non_blocking=False):
            if src.device.type == "cpu" and dst.device.type == "cuda":
                key = (state["turn"], tuple(src.shape), src.dtype)
                buf = state["bufs"].get(key)
                if buf is None:
                    buf = state["bufs"][key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                real_copy(buf, src)
                src = buf
            return real_copy(dst, src, non_blocking=non_blocking)

        torch.Tensor.copy_ = staged
        try:
            return original(self, shape, *args, **kwargs)
        finally:
            torch.Tensor.copy_ = real_copy
            state["turn"] ^= 1
    return fill


def run(models, overlap: bool, pinned: bool) -> dict:
    engine = _engine(models, _engine_config({"max_num_seqs": B, "async_scheduling": overlap}), False)
    rng = random.Random(0)
    ids = [f"r{i}" for i in range(B)]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 200, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(PROMPT)]}, params)
    seqs = [engine.groups[r].seqs[0] for r in ids]
    while not all(s.output_ids for s in seqs):
        engine.step(unfinished_outputs=False)
    spent: dict[str, list[float]] = {}
    runner = engine.executor.runner
    graphs = runner.graphs
    saved_fill = cuda_graphs.StepGraphs._fill
    if pinned:
        cuda_graphs.StepGraphs._fill = pinned_fill(saved_fill)
    sampler = engine.executor.worker.sampler  # the worker samples (worker/sample_step.py)
    patches = [(engine.executor, "execute_model"), (runner, "step_block_table"), (sampler, "sample_rows"),
               (sampler, "sample_device")]
    for owner, name in patches:
        setattr(owner, name, timed(spent, name, getattr(owner, name)))
    if graphs is not None:
        graphs._fill = timed(spent, "_fill", graphs._fill)
        graphs.steps = {shape: timed(spent, "replay", fn) for shape, fn in graphs.steps.items()}
    walls = []
    try:
        for _ in range(10):
            engine.step(unfinished_outputs=False)
        spent.clear()
        for _ in range(STEPS):
            t0 = time.perf_counter()
            engine.step(unfinished_outputs=False)
            walls.append(time.perf_counter() - t0)
    finally:
        cuda_graphs.StepGraphs._fill = saved_fill
        for owner, name in patches:
            delattr(owner, name)
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    row = {"overlap": overlap, "pinned": pinned, "wall_ms": 1e3 * statistics.median(walls)}
    row.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in spent.items()})
    # let the KV cache and the graphs' pools go before the next engine sizes its cache from free memory
    engine.executor.shutdown()
    del engine, runner, graphs, seqs, patches
    gc.collect()
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    return row


def main():
    models = load_models("smollm2-135m-dummy", DEV)
    rows = [run(models, overlap, pinned) for pinned in (False, True) for overlap in (True, False)]
    keys = ["overlap", "pinned", "wall_ms", "execute_model_ms", "step_block_table_ms", "_fill_ms", "replay_ms",
            "sample_rows_ms", "sample_device_ms"]
    print(" ".join(f"{k:>20s}" for k in keys))
    for r in rows:
        print(" ".join(f"{r.get(k, float('nan')):>20.3f}" if isinstance(r.get(k), float) else f"{r.get(k)!s:>20s}"
                       for k in keys))
    with open(os.path.join(OUT, "launch_phase.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "B": B,
                   "prompt": PROMPT, "steps": STEPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
