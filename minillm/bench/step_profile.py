"""Where a decode step's time goes: `profile_decode_step(engine, batch_size)` (chapters 07 and 13).

A decode step of a small model does little GPU work; what it costs beyond its kernels is the host:
scheduling, packing the inputs, launching (or replaying a CUDA graph), sampling, bookkeeping. This
runs `batch_size` requests into steady-state decode on an idle engine and measures, per step:

    wall_ms          one engine.step(), call to call, the GPU kept busy as in serving (no added waits)
    gpu_kernel_ms    (GPU) the sum of the kernels' durations, from torch.profiler; None on a CPU
    gpu_busy_pct     (GPU) kernels / wall: the share of the step the GPU was working
    gap_ms           (GPU) wall - kernels: time the GPU sat idle waiting for the host
    kernels_per_step, kernels_per_layer   (GPU) kernel launches in one step, and per decoder layer
    top_kernels      (GPU) the kernels that take the most time per step: name, launches, µs
    top_host_ops     (GPU) the host-side operations (torch ops, CUDA runtime calls such as the graph
                     launch) that take the most CPU time of their own per step
    schedule_ms, prepare_ms, launch_ms, sample_ms, other_ms
                     host time by phase: Scheduler.schedule; packing the ModelInput; the executor's
                     execute_model without its sampling (input copies, graph replay or eager
                     launches); sampling, by the worker inside execute_model (queued on the GPU with
                     overlap, a wait for the GPU's tokens without it); and the rest
                     (bookkeeping: appending tokens, stop checks, outputs; with overlap it also waits
                     for the previous step's tokens). Measured in a separate pass with timers around
                     each phase, which add a little host time of their own.

Each step is taken as `LLM.generate` and the engine core take it, `step(unfinished_outputs=False)`: only
finished requests come back as RequestOutputs. `streaming=True` profiles `step()` as a streaming caller
takes it instead, one RequestOutput (its text detokenized so far) per running request per step: at batch
256 on a GPU that bookkeeping was the largest part of "other" (chapters/bench/h200-2026-11-26/).

Each figure is a median over `steps` steps. The requests are aborted at the end, leaving the engine idle.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings

import torch

from ..checks import check_int
from ..sampling import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(engine, n: int, streaming: bool = False) -> list[float]:
    """Seconds between consecutive step() returns: what a caller that steps in a loop sees."""
    out, t0 = [], time.perf_counter()
    for _ in range(n):
        engine.step(unfinished_outputs=streaming)
        t1 = time.perf_counter()
        out.append(t1 - t0)
        t0 = t1
    return out


def _kernels(engine, n: int, top: int, streaming: bool) -> tuple[float, float, list[dict], list[dict]]:
    """Kernel (and memcpy/memset) seconds and launches per step over n steps, by torch.profiler; the top
    kernels by time, and the host-side operations (torch ops, CUDA runtime calls) by their own CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # torch.profiler's notes about its own event buffers
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                engine.step(unfinished_outputs=streaming)
            torch.cuda.synchronize()
        averages = prof.key_averages()
    rows, host = [], []
    for evt in averages:
        if evt.device_type == DeviceType.CUDA:  # device activity only: CPU ops would count their kernels twice
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
            rows.append({"name": evt.key[:80], "launches_per_step": evt.count / n, "us_per_step": us / n})
        else:
            host.append({"name": evt.key[:80], "calls_per_step": evt.count / n,
                         "host_us_per_step": evt.self_cpu_time_total / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    host.sort(key=lambda r: -r["host_us_per_step"])
    total_s = sum(r["us_per_step"] for r in rows) / 1e6
    launches = sum(r["launches_per_step"] for r in rows if not r["name"].startswith("Memcpy"))
    return total_s, launches, rows[:top], host[:top]


def _host_split(engine, n: int, streaming: bool) -> dict:
    """Per-phase host seconds per step, by wrapping the phases' methods on these instances for n steps."""
    # the worker samples inside execute_model: its sampler is timed apart and taken out of "launch"
    phases = {"schedule": (engine.scheduler, "schedule"), "prepare": (engine, "_prepare"),
              "launch": (engine.executor, "execute_model"), "sample": (engine.executor.worker, "sampler")}
    spent = {key: [0.0] * n for key in phases}
    step = [0]

    def wrap(key, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key][step[0]] += time.perf_counter() - t0

        return timed

    saved = {key: vars(owner).get(name) for key, (owner, name) in phases.items()}  # instance attributes
    for key, (owner, name) in phases.items():
        setattr(owner, name, wrap(key, getattr(owner, name)))  # an instance attribute shadows the method
    walls = []
    try:
        for i in range(n):
            step[0] = i
            t0 = time.perf_counter()
            engine.step(unfinished_outputs=streaming)
            walls.append(time.perf_counter() - t0)
    finally:
        for key, (owner, name) in phases.items():
            if saved[key] is None:
                delattr(owner, name)
            else:
                setattr(owner, name, saved[key])
    sample = spent["sample"]
    launch = [a - b for a, b in zip(spent["launch"], sample)]  # the forward pass's launch, sampling apart
    named = [sum(v) for v in zip(spent["schedule"], spent["prepare"], spent["launch"])]
    med = statistics.median
    return {"schedule_ms": 1e3 * med(spent["schedule"]), "prepare_ms": 1e3 * med(spent["prepare"]),
            "launch_ms": 1e3 * med(launch), "sample_ms": 1e3 * med(sample),
            "other_ms": 1e3 * med(w - s for w, s in zip(walls, named)), "instrumented_wall_ms": 1e3 * med(walls)}


def profile_decode_step(engine, batch_size: int, *, steps: int = 10, warmup: int = 3, prompt_len: int = 32,
                        seed: int = 0, top: int = 8, streaming: bool = False) -> dict:
    """Where one decode step of `batch_size` running requests spends its time (see the module docstring)."""
    for name, value in (("batch_size", batch_size), ("steps", steps), ("prompt_len", prompt_len), ("top", top)):
        check_int(name, value)
    if not isinstance(streaming, bool):
        raise TypeError(f"streaming must be a bool, got {type(streaming).__name__}")
    if batch_size > engine.config.max_num_seqs:
        raise ValueError(f"batch_size ({batch_size}) exceeds the engine's max_num_seqs ({engine.config.max_num_seqs})")
    if engine.has_unfinished_requests():
        raise ValueError("profile_decode_step needs an idle engine (it has unfinished requests)")
    device = engine.sizes.device
    gpu = device.type == "cuda"
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    # Prompts are prefilled in chunks, and a request decodes from the step after its prompt is in, so
    # the first requests are ahead of the last by as many tokens as the prefill takes steps. A step's
    # budget goes to the decoding requests first (up to batch_size - 1 of them), the rest to prompt
    # chunks: each request gets room for that many steps, the warm-up and three measured passes.
    per_step = max(1, engine.config.max_num_batched_tokens - batch_size + 1)  # prompt tokens a step, at least
    staggered = -(-batch_size * prompt_len // per_step) + 1
    new = staggered + warmup + 3 * steps + 4
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}, params)
    try:
        seqs = [engine.groups[rid].seqs[0] for rid in ids]
        while not all(s.output_ids for s in seqs):  # prefills (maybe chunked) until everyone decodes
            engine.step(unfinished_outputs=False)
        _timed_steps(engine, warmup, streaming)
        preempted = engine.stats["num_preemptions"]
        wall = statistics.median(_timed_steps(engine, steps, streaming))
        kernel_s, launches, top_rows, host_ops = _kernels(engine, steps, top, streaming) if gpu else (None, None, [], [])
        host = _host_split(engine, steps, streaming)
        if engine.stats["num_preemptions"] != preempted:
            raise RuntimeError("requests were preempted while profiling: give the engine more KV blocks")
        if any(s.finished for s in seqs):  # the measured steps ran a smaller batch than batch_size
            raise RuntimeError("a request finished while profiling: the measured steps did not all run "
                               f"{batch_size} sequences")
        layers = getattr(engine.model.config, "num_layers", None)  # minillm ModelConfig's name
        return {"device": str(device), "batch_size": batch_size, "steps": steps,
                "context_len": prompt_len + warmup + steps, "cuda_graphs": engine.runner.use_cuda_graphs,
                "async_scheduling": engine.async_scheduling, "streaming": streaming, "wall_ms": 1e3 * wall,
                "gpu_kernel_ms": 1e3 * kernel_s if gpu else None,
                "gpu_busy_pct": 100 * kernel_s / wall if gpu else None,
                "gap_ms": 1e3 * (wall - kernel_s) if gpu else None,
                "kernels_per_step": launches, "kernels_per_layer": launches / layers if gpu and layers else None,
                "top_kernels": top_rows, "top_host_ops": host_ops, **host}
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():  # the step in flight (overlap) ends with the aborted requests
            engine.step()
