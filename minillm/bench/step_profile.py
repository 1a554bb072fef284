"""Where a decode step's time goes: `profile_decode_step(engine, batch_size)` (chapter 07).

A decode step of a small model does little GPU work; what it costs beyond its kernels is the host:
scheduling, packing the inputs, launching (or replaying a CUDA graph), sampling, bookkeeping. This
runs `batch_size` requests into steady-state decode on an idle engine and measures, per step:

    wall_ms        one engine.step(), start to finish (the step ends on the host, after the sampled
                   tokens came back, so the GPU work is inside it)
    gpu_kernel_ms  (GPU) the sum of the kernels' durations, from torch.profiler; None on a CPU
    gap_ms         (GPU) wall - kernels: time the GPU sat idle waiting for the host (launches, Python)
    schedule_ms, prepare_ms, model_ms, sample_ms, other_ms
                   host time by phase: Scheduler.schedule, ModelRunner.prepare, the rest of
                   ModelRunner.execute (the forward pass, up to the GPU finishing it: a
                   synchronize is added after it, so sampling is not billed for the GPU's work),
                   the sampler (argmax and the copy of the tokens to the host), and what is left
                   (stop checks, detokenizing, outputs). Measured in a separate pass, since the
                   added synchronize changes the step a little.

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


def _timed_steps(engine, n: int, device) -> list[float]:
    out = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _kernel_seconds(engine, n: int) -> float:
    """Sum of GPU kernel (and memcpy/memset) durations over n steps, by torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # torch.profiler's notes about its own event buffers
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                engine.step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
    total_us = 0.0
    for evt in averages:
        if evt.device_type == DeviceType.CUDA:  # device activity only: CPU ops would count their kernels twice
            total_us += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total_us / 1e6


def _host_split(engine, n: int, device) -> dict:
    """Per-phase host seconds per step, by wrapping the phases' methods on these instances for n steps."""
    spent = {"schedule": [], "prepare": [], "execute": [], "sample": []}
    owners = {"schedule": engine.scheduler, "prepare": engine.runner, "execute": engine.runner, "sample": engine}
    names = {"schedule": "schedule", "prepare": "prepare", "execute": "execute", "sample": "_sample"}

    def wrap(key):
        fn = getattr(owners[key], names[key])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            if key == "execute":
                _sync(device)  # the forward pass ends when the GPU is done, not when its launches are
            spent[key].append(time.perf_counter() - t0)
            return result

        return timed

    for key in spent:
        setattr(owners[key], names[key], wrap(key))  # an instance attribute shadows the method
    try:
        walls = _timed_steps(engine, n, device)
    finally:
        for key in spent:
            delattr(owners[key], names[key])
    per = spent  # one entry per step and phase (each phase runs once in a decode step)
    model = [e - p for e, p in zip(per["execute"], per["prepare"])]  # prepare runs inside execute
    other = [w - s - e - m for w, s, e, m in zip(walls, per["schedule"], per["execute"], per["sample"])]
    med = statistics.median
    return {"schedule_ms": 1e3 * med(per["schedule"]), "prepare_ms": 1e3 * med(per["prepare"]),
            "model_ms": 1e3 * med(model), "sample_ms": 1e3 * med(per["sample"]), "other_ms": 1e3 * med(other),
            "instrumented_wall_ms": 1e3 * med(walls)}


def profile_decode_step(engine, batch_size: int, *, steps: int = 10, warmup: int = 3, prompt_len: int = 32,
                        seed: int = 0) -> dict:
    """Where one decode step of `batch_size` running requests spends its time (see the module docstring)."""
    for name, value in (("batch_size", batch_size), ("steps", steps), ("prompt_len", prompt_len)):
        check_int(name, value)
    if batch_size > engine.config.max_num_seqs:
        raise ValueError(f"batch_size ({batch_size}) exceeds the engine's max_num_seqs ({engine.config.max_num_seqs})")
    if engine.has_unfinished_requests():
        raise ValueError("profile_decode_step needs an idle engine (it has unfinished requests)")
    device = engine.cache.device
    gpu = device.type == "cuda"
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    new = warmup + 3 * steps + 2  # three measured passes, and room so nobody finishes inside one
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}, params)
    try:
        seqs = [engine.groups[rid].seqs[0] for rid in ids]
        while not all(s.output_ids for s in seqs):  # prefills (maybe chunked) until everyone decodes
            engine.step()
        _timed_steps(engine, warmup, device)
        preempted = engine.stats["num_preemptions"]
        walls = _timed_steps(engine, steps, device)
        kernel = _kernel_seconds(engine, steps) / steps if gpu else None
        host = _host_split(engine, steps, device)
        if engine.stats["num_preemptions"] != preempted:
            raise RuntimeError("requests were preempted while profiling: give the engine more KV blocks")
        wall = statistics.median(walls)
        return {"device": str(device), "batch_size": batch_size, "steps": steps,
                "context_len": prompt_len + warmup + steps, "cuda_graphs": engine.runner.use_cuda_graphs,
                "wall_ms": 1e3 * wall, "gpu_kernel_ms": 1e3 * kernel if gpu else None,
                "gap_ms": 1e3 * (wall - kernel) if gpu else None, **host}
    finally:
        engine.abort_request(ids)
