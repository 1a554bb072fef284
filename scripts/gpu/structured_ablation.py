"""Chapter 14 (issue 47): where a constrained decode step's extra time goes, by ablation.

    python3 scripts/gpu/structured_ablation.py --json $OUT/structured-ablation.json [--profile-dir $OUT]

One engine (the embedded SmolLM2-135M-Instruct unless --model), CUDA graphs, warmed up once; per batch size
(1, and 64 with half the batch constrained) six modes, each repeat in a rotated order:

    free-overlap  free-sync            every request free; async_scheduling on / off
    real-overlap  real-sync            the constrained requests ask for the JSON list schema (bench structured's)
    stub-overlap  stub-sync            the same requests through the same path (deferred sampling, the mask
                                       upload, the apply kernel), but their matcher is a stub: an all-ones
                                       row (EOS cleared, so they run to max_tokens) copied in, accept a no-op

so, per step (medians of step_ms over the repeats):
    overlap lost   real-sync - real-overlap   (what the plain step costs a constrained batch)
    mask path      stub-overlap - free-overlap   (deferred sampling + upload + apply, no grammar)
    grammar        real-overlap - stub-overlap   (the matchers' host time, where the GPU waits for it)
and the targets: real-overlap / free-overlap tok/s (>= 0.90 at batch 1, >= 0.85 at batch 64 half constrained).
The host phases of each mode are timed too (schedule, execute_model, the wait for the previous tokens and
the grammars' accept, bitmask, sample_tokens, the bookkeeping): on a GPU, the `wait` phase is the host
idle because it is ahead of the GPU; with --profile-dir, a torch.profiler table of 16 steps of each overlap
mode at the largest batch (device time per step against the step's wall time).

Engine flips async_scheduling between runs (an attribute read each step; the engine is idle then). On a
CPU (the default there: batch 1 and 4, 8 tokens, 1 repeat... --quick) it checks itself and shows the host
accounting; its step times mean nothing for a GPU. Expected on an H200: about 90 s (warm-up ~30 s, 2 batch
sizes x 6 modes x 3 repeats of 64 tokens, the profile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from minillm.bench import structured_cases as cases_
from minillm.bench.serving_setup import free_engine, load_models
from minillm.bench.structured import versions
from minillm.engine import EngineConfig, LLMEngine
from minillm.hw import default_device
from minillm.sampling import SamplingParams
from minillm.structured_output import StructuredOutputsParams

MODES = ("free-overlap", "real-overlap", "stub-overlap", "free-sync", "real-sync", "stub-sync")


class StubMatcher:
    """A matcher that allows every token but EOS and never moves: the mask path without the grammar."""

    row: np.ndarray = None  # [W] int32, set per engine

    def __init__(self, compiled):
        pass

    def fill_bitmask(self, row) -> None:
        np.copyto(row, StubMatcher.row)

    def accept_token(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class PhaseClock:
    """Host seconds per phase of the engine's step (instance attributes over the methods; close() removes)."""

    PHASES = (("scheduler", "schedule", "schedule"), ("executor", "execute_model", "execute"),
              ("engine", "accept_grammars", "wait+accept"), ("structured", "bitmask", "bitmask"),
              ("executor", "sample_tokens", "sample"), ("engine", "_process", "process"))

    def __init__(self, engine):
        self.engine, self.seconds, self.patched = engine, defaultdict(float), []
        for owner, name, label in self.PHASES:
            obj = engine if owner == "engine" else getattr(engine, owner)
            fn = getattr(obj, name)

            def timed(*a, _fn=fn, _label=label, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds[_label] += time.perf_counter() - t0
            setattr(obj, name, timed)
            self.patched.append((obj, name))

    def close(self):
        for obj, name in self.patched:
            delattr(obj, name)


def run_mode(engine, prompt, batch: int, constrained: int, mode: str, max_tokens: int, tag: str) -> dict:
    kind, how = mode.split("-")
    engine.async_scheduling = how == "overlap"
    engine.structured._matcher = StubMatcher if kind == "stub" else engine._real_matcher
    so = StructuredOutputsParams(json=cases_.PEOPLE_SCHEMA)
    n_constrained = 0 if kind == "free" else constrained
    for i in range(batch):
        sp = (SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so) if i < n_constrained
              else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, sp)
    clock, steps = PhaseClock(engine), []
    try:
        while engine.has_unfinished_requests():
            s = engine.scheduler
            decode = not s.waiting and all(q.num_tokens - q.num_computed_tokens <= 1 for q in s.running)
            running, tokens = len(s.running), engine.engine_stats.num_generation_tokens
            phases = dict(clock.seconds)
            t0 = time.perf_counter()
            engine.step(unfinished_outputs=False)
            dt = time.perf_counter() - t0
            steps.append((decode, dt, engine.engine_stats.num_generation_tokens - tokens, running,
                          {k: v - phases.get(k, 0.0) for k, v in clock.seconds.items()}))
    finally:
        clock.close()
        engine.structured._matcher = engine._real_matcher
    dec = [x for x in steps if x[0] and x[2]] or steps
    full = [x for x in dec if x[3] == batch] or dec
    return {"batch": batch, "mode": mode, "constrained": n_constrained,
            "tok_s": sum(x[2] for x in full) / sum(x[1] for x in full), "full_batch_steps": len(full),
            "step_ms": 1e3 * statistics.median(x[1] for x in full),
            "phase_ms": {k: 1e3 * statistics.median(x[4].get(k, 0.0) for x in full) for _, _, k in PhaseClock.PHASES}}


def spread(vals) -> dict:
    vals = [float(v) for v in vals]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def profile(engine, prompt, batch, constrained, mode, max_tokens, path_prefix) -> dict:
    """16 decode steps under torch.profiler: device busy ms per step against the wall ms per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    kind, how = mode.split("-")
    engine.async_scheduling = how == "overlap"
    engine.structured._matcher = StubMatcher if kind == "stub" else engine._real_matcher
    so = StructuredOutputsParams(json=cases_.PEOPLE_SCHEMA)
    for i in range(batch):
        sp = (SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so) if i < constrained and
              kind != "free" else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        engine.add_request(f"prof-{mode}-{i}", {"prompt_token_ids": prompt}, sp)
    for _ in range(4):  # the prompt and a few decode steps first
        engine.step(unfinished_outputs=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tprofile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(16):
            engine.step(unfinished_outputs=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step(unfinished_outputs=False)
    engine.structured._matcher = engine._real_matcher
    events = prof.key_averages()
    dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(f"{path_prefix}-{mode}.txt", "w") as f:
        f.write(events.table(sort_by=sort, row_limit=40))
    return {"mode": mode, "batch": batch, "wall_ms_per_step": 1e3 * wall / 16, "device_ms_per_step": dev / 1e3 / 16}


def run(model=None, *, tokenizer=None, device=None, batch_sizes=None, max_tokens=None, repeats=None,
        backend="minillm", json_path=None, profile_dir=None, **engine_args) -> dict:
    """The ablation (see the module docstring) -> its JSON. model: what load_models takes (a path, a
    ModelConfig for random weights: then pass tokenizer=)."""
    device = torch.device(device) if device else default_device()
    gpu = device.type == "cuda"
    batch_sizes = batch_sizes or ([1, 64] if gpu else [1, 4])
    max_tokens = max_tokens or (64 if gpu else 8)
    repeats = repeats or (3 if gpu else 1)
    t0 = time.perf_counter()
    models = load_models(model, device)
    tok = tokenizer if tokenizer is not None else models.tokenizer
    engine = LLMEngine(models.model, tok, sorted(set(models.config.eos_token_ids or [tok.eos_token_id])),
                       EngineConfig(structured_outputs_backend=backend, **engine_args), progress=False)
    engine._real_matcher = engine.structured._matcher
    W = (models.config.vocab_size + 31) // 32
    row = np.full(W, -1, dtype=np.int32)
    for t in engine.eos_token_ids:  # EOS cleared: a stub request runs to max_tokens, like a free one
        row[t >> 5] &= ~np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    StubMatcher.row = row
    if gpu:
        engine.warm_up(max_prompt_len=256)
    prompt = cases_.chat_ids(tok, cases_.PEOPLE_PROMPT)
    rows, summary = [], {}
    for b in batch_sizes:
        constrained = 1 if b == 1 else b // 2
        run_mode(engine, prompt, b, constrained, "free-overlap", 2, f"warm{b}")  # this batch's shapes, untimed
        run_mode(engine, prompt, b, constrained, "real-overlap", 2, f"warmc{b}")
        per = defaultdict(list)
        for r in range(repeats):
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]  # rotated: no mode always first or last
            order = order if r % 2 == 0 else tuple(reversed(order))
            for mode in order:
                res = run_mode(engine, prompt, b, constrained, mode, max_tokens, f"{mode}-{b}-{r}")
                res["repeat"] = r
                rows.append(res)
                per[mode].append(res)
                print(f"batch {b:3d} {mode:13s} r{r}: {res['tok_s']:9.1f} tok/s  step {res['step_ms']:.3f} ms  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in res["phase_ms"].items()), flush=True)

        def step(mode, per=per):
            return statistics.median(x["step_ms"] for x in per[mode])

        def ratio(a_, b_, per=per):
            return spread([x["tok_s"] / y["tok_s"] for x, y in zip(per[a_], per[b_])])
        summary[f"batch{b}"] = {
            "constrained": constrained,
            "real_overlap_vs_free_overlap": ratio("real-overlap", "free-overlap"),
            "real_sync_vs_free_overlap": ratio("real-sync", "free-overlap"),
            "stub_overlap_vs_free_overlap": ratio("stub-overlap", "free-overlap"),
            "free_sync_vs_free_overlap": ratio("free-sync", "free-overlap"),
            "step_ms": {m: spread([x["step_ms"] for x in per[m]]) for m in MODES},
            "per_step_ms": {"overlap_lost": step("real-sync") - step("real-overlap"),
                            "mask_path": step("stub-overlap") - step("free-overlap"),
                            "mask_path_sync": step("stub-sync") - step("free-sync"),
                            "grammar": step("real-overlap") - step("stub-overlap"),
                            "grammar_host": statistics.median(
                                x["phase_ms"]["bitmask"] for x in per["real-overlap"])},
        }
        print(json.dumps({k: (v["median"] if isinstance(v, dict) and "median" in v else v)
                          for k, v in summary[f"batch{b}"].items() if k != "step_ms"}, indent=1), flush=True)
    profiles = []
    if profile_dir:
        b = max(batch_sizes)
        for mode in ("free-overlap", "real-overlap", "stub-overlap"):
            profiles.append(profile(engine, prompt, b, 1 if b == 1 else b // 2, mode, max_tokens + 8,
                                    f"{profile_dir}/structured-profile"))
            print(profiles[-1], flush=True)
    free_engine(engine)
    result = {"script": "scripts/gpu/structured_ablation.py", "device": str(device), "versions": versions(),
              "model": models.label, "backend": backend, "batch_sizes": batch_sizes, "max_tokens": max_tokens,
              "repeats": repeats, "wall_s": time.perf_counter() - t0, "rows": rows, "summary": summary,
              "profiles": profiles, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--backend", choices=["minillm", "xgrammar"], default="minillm")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--profile-dir", default=None)
    return run(**vars(ap.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
