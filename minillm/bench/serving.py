"""Benchmarks: serving throughput and single-request latency, minillm's engine vs HF `generate` (chapter 07).

    minillm bench throughput [--model qwen3-0.6b-dummy] [--num-requests 256] [--no-hf] [--json out.json]
    minillm bench latency    [--input-len 128] [--output-len 256] [--num-iters 3]

    from minillm.bench.serving import throughput, latency, profile_decode_step
    res = throughput(num_requests=64)      # prints the table, returns a JSON-ready dict

throughput  The workload nano-vllm and mini-sglang publish: 256 requests, prompt and output lengths
            uniform in [100, 1024], random token ids, greedy, EOS ignored (every request makes exactly
            its output length). All of them go to LLMEngine at once; it is stepped until done
            (continuous batching, chapter 07). The peer, on the same requests in the same process:
            HF `generate` with static batches (hf_peer.py), where only each request's own tokens count.
            Both are warm when the clock starts: the engine has run warm_up, HF one untimed whole batch.
latency     Batch 1: a 128-token prompt, 256 new tokens; the median of 3 runs after a warm-up. Decode
            is memory-bound: every step must read all the weights (and the KV cache so far), so
            bytes / measured copy bandwidth is a floor no implementation can beat; the table says
            how close each one gets.

On a CPU, sizes not given explicitly shrink (with a printed note), so that the benchmark finishes in
seconds: its numbers then say the code runs, not how fast a GPU serves.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

from ..checks import check_int
from ..engine import EngineConfig, LLMEngine
from ..executor import MultiprocExecutor, start_tensor_parallel
from ..executor.multiproc_executor import check_tp_engine, check_tp_quantization, check_tp_size, stop_workers
from ..hw import default_device
from ..sampling import SamplingParams
from . import hf_peer
from .serving_setup import (
    check_range,
    free_engine,
    header,
    load_models,
    percentiles,
    random_requests,
)
from .step_profile import profile_decode_step  # noqa: F401  (part of this module's API)
from .table import print_table

# sizes: (GPU default, CPU default); the CPU ones keep a laptop run to seconds
THROUGHPUT_SIZES = dict(num_requests=(256, 8), min_input_len=(100, 16), max_input_len=(1024, 64),
                        min_output_len=(100, 16), max_output_len=(1024, 64), hf_batch_size=(64, 4))
LATENCY_SIZES = dict(input_len=(128, 32), output_len=(256, 32))
ENGINE_ARGS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "enforce_eager",
               "num_gpu_blocks", "preemption_mode", "enable_prefix_caching", "cuda_graph_max_tokens", "kv_cache_dtype",
               "async_scheduling", "kv_offload_gb", "kv_offload_blocks",
               "decode_backend")


def _sizes(defaults: dict, given: dict, device: torch.device) -> dict:
    """Fill the sizes left as None with the device's defaults; say so on a CPU."""
    cpu = device.type != "cuda"
    out = {k: given[k] if given[k] is not None else v[cpu] for k, v in defaults.items()}
    shrunk = [f"{k}={out[k]}" for k in defaults if given[k] is None and defaults[k][0] != defaults[k][1]]
    if cpu and shrunk:
        print(f"note: on a CPU the default sizes shrink ({', '.join(shrunk)}); give them to override")
    return out


def _engine_config(engine_args: dict) -> EngineConfig:
    unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
    if unknown:
        raise ValueError(f"unknown engine arguments {unknown}; allowed: {', '.join(ENGINE_ARGS)}")
    return EngineConfig(**{k: v for k, v in engine_args.items() if v is not None})


def _load(model, device: torch.device, quantization, engine_args: dict, tp: int, hf: bool):
    """-> (models, the engine's config, the tensor-parallel worker processes or None). With tp > 1 this
    process becomes rank 0 and loads its shard (chapter 11); the HF peer cannot shard: hf must be off."""
    config = _engine_config(engine_args)
    check_tp_size(tp, device)
    if tp == 1:
        return load_models(model, device, quantization=quantization), config, None
    if hf:
        raise ValueError("the HF generate peer runs on one device: use --no-hf with --tensor-parallel-size > 1")
    check_tp_engine(config)
    check_tp_quantization(quantization)
    procs = start_tensor_parallel(tp, "minillm.bench.serving_setup:load_models",
                                  dict(model=model, quantization=quantization), config, device.type)
    try:
        return load_models(model, device, quantization=quantization), config, procs
    except BaseException:
        stop_workers(procs)
        raise


def _engine(models, config: EngineConfig, progress: bool, procs=None) -> LLMEngine:
    executor = MultiprocExecutor(procs, models.model, config) if procs is not None else None
    return LLMEngine(models.model, models.tokenizer, models.config.eos_token_ids, config, progress, executor)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run_all(engine: LLMEngine, requests, prefix: str, progress: bool, desc: str = "") -> dict:
    """Add every request, step until all are done; -> {request_id: final RequestOutput}."""
    from tqdm.auto import tqdm

    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt}, _greedy(n))
    done, stats = {}, engine.engine_stats
    with tqdm(total=sum(n for _, n in requests), desc=desc, unit="tok", disable=not progress) as bar:
        made = stats.num_generation_tokens
        while engine.has_unfinished_requests():
            # as LLM.generate steps: only finished requests come back. A streaming caller's output for
            # every running request at every step is its own cost, not the offline engine's.
            outs = engine.step(unfinished_outputs=False)
            bar.update(stats.num_generation_tokens - made)
            made = stats.num_generation_tokens
            done.update((o.request_id, o) for o in outs if o.finished)
    return done


def _write(result: dict, json_path) -> dict:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {json_path}")
    return result


def throughput(model=None, *, num_requests: int | None = None, min_input_len: int | None = None,
               max_input_len: int | None = None, min_output_len: int | None = None,
               max_output_len: int | None = None, seed: int = 0, hf: bool = True, hf_batch_size: int | None = None,
               hf_requests: int | None = None, device=None, json_path=None, progress: bool = True,
               quantization=None, tensor_parallel_size: int = 1, **engine_args) -> dict:
    """Offline throughput of LLMEngine on random requests, and of HF static batching on the same ones."""
    device = default_device() if device is None else torch.device(device)
    s = _sizes(THROUGHPUT_SIZES, dict(num_requests=num_requests, min_input_len=min_input_len,
                                      max_input_len=max_input_len, min_output_len=min_output_len,
                                      max_output_len=max_output_len, hf_batch_size=hf_batch_size), device)
    check_int("num_requests", s["num_requests"])
    check_range("input_len", s["min_input_len"], s["max_input_len"])
    check_range("output_len", s["min_output_len"], s["max_output_len"])
    check_int("hf_batch_size", s["hf_batch_size"])
    check_int("seed", seed, 0)
    n_hf = s["num_requests"] if hf_requests is None else hf_requests
    check_int("hf_requests", n_hf)
    if n_hf > s["num_requests"]:
        raise ValueError(f"hf_requests ({n_hf}) must be <= num_requests ({s['num_requests']})")

    models, config, procs = _load(model, device, quantization, engine_args, tensor_parallel_size, hf)
    longest = s["max_input_len"] + s["max_output_len"]
    if longest > models.config.max_position_embeddings:
        raise ValueError(f"max_input_len + max_output_len = {longest} exceeds the model's context "
                         f"({models.config.max_position_embeddings} tokens)")
    rng = random.Random(seed)
    requests = random_requests(rng, s["num_requests"], (s["min_input_len"], s["max_input_len"]),
                               (s["min_output_len"], s["max_output_len"]), models.config.vocab_size)
    info = header(f"throughput: {s['num_requests']} requests, prompts {s['min_input_len']}-{s['max_input_len']}, "
                  f"outputs {s['min_output_len']}-{s['max_output_len']} tokens (random ids, greedy, EOS ignored); "
                  f"{models.label}, {models.dtype_name}")

    engine = _engine(models, config, progress, procs)
    engine.warm_up(s["max_input_len"])  # outside the clock: Triton tunes the prefill kernel per length bucket
    preempted_before = engine.stats["num_preemptions"]
    start = time.perf_counter()
    done = _run_all(engine, requests, "", progress, desc="minillm engine")
    elapsed = time.perf_counter() - start
    stats = engine.stats
    ttft, tpot, itl, per_request = [], [], [], []
    for i, (prompt, n) in enumerate(requests):
        out = done[str(i)]
        m, got = out.metrics, len(out.outputs[0].token_ids)
        if got != n:  # ignore_eos + max_tokens: anything else is an engine bug, not a number to print
            raise RuntimeError(f"request {i} got {got} tokens, asked for exactly {n}")
        times = m.token_times[0]
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
        itl += [b - a for a, b in zip(times, times[1:])]
        per_request.append({"prompt_len": len(prompt), "output_len": n, "generated": got,
                            "ttft_s": ttft[-1], "tpot_s": tpot[-1] if n > 1 else None})
    out_tokens, prompt_tokens = sum(n for _, n in requests), sum(len(p) for p, _ in requests)
    ours = {"engine": "minillm", "num_requests": len(requests), "elapsed_s": elapsed,
            "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (out_tokens + prompt_tokens) / elapsed,
            **percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"), **percentiles(itl, "itl"),
            "peak_used_blocks": stats["peak_used_blocks"], "num_blocks": stats["num_blocks"],
            "num_preemptions": stats["num_preemptions"] - preempted_before, "useful_pct": 100.0}
    free_engine(engine)
    print(f"minillm: {ours['output_tok_s']:,.0f} output tok/s ({elapsed:.1f} s)" + (", now HF generate" if hf else ""))

    peer, ratio = None, None
    if hf:
        hf_model = hf_peer.load_hf(models.hf_source, models.dtype, device)
        # Warm-up, untimed: one whole batch of the real shape. A cold first batch of 64 x ~2k tokens runs
        # several times slower than the next ones (allocator growth, first kernels of each shape);
        # timing it would charge HF with a one-off cost that minillm's warm_up keeps off its clock.
        warm = requests[: s["hf_batch_size"]]
        hf_peer.static_batches(hf_model, warm, len(warm), device, progress, desc="HF generate, warm-up batch")
        peer = {"engine": f"HF generate (static, batch {s['hf_batch_size']})",
                **hf_peer.static_batches(hf_model, requests[:n_hf], s["hf_batch_size"], device, progress)}
        ratio = ours["output_tok_s"] / peer["output_tok_s"]
        del hf_model

    cols = ["engine", "num_requests", "elapsed_s", "output_tok_s", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms",
            "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "peak_used_blocks", "num_preemptions",
            "useful_pct"]
    print_table([ours] + ([peer] if peer else []), cols)
    if peer:
        subset = f" (HF on the first {n_hf} of {len(requests)} requests)" if n_hf < len(requests) else ""
        print(f"minillm / HF output tok/s: {ratio:.2f}x{subset}; HF useful tokens: {peer['useful_pct']:.0f}% "
              f"of {peer['generated_tokens']} generated (the rest is static batching's padding)")
    print(f"KV blocks: peak {ours['peak_used_blocks']} of {ours['num_blocks']} "
          f"(block_size {engine.config.block_size}), {ours['num_preemptions']} preemptions")
    result = {**info, "workload": "throughput", "model": models.label, "dtype": models.dtype_name,
              "device": str(device), "tensor_parallel_size": tensor_parallel_size, "seed": seed, **s,
              "hf_requests": n_hf if hf else None,
              "engine_config": {k: getattr(engine.config, k) for k in ENGINE_ARGS},
              "minillm": ours, "hf": peer, "ratio": ratio, "requests": per_request}
    return _write(result, json_path)


def _decode_floor(models, input_len: int, output_len: int, copy_gbps: float) -> float:
    """Seconds the output_len - 1 decode steps after the first token cannot beat: the step making
    token j (j = 2..n) reads every weight once and the K/V of input_len + j - 1 positions."""
    w, kv = models.weight_bytes(), models.kv_bytes_per_token()
    nbytes = sum(w + kv * (input_len + j - 1) for j in range(2, output_len + 1))
    return nbytes / (copy_gbps * 1e9)


def _latency_row(engine: str, runs: list[tuple[float, list[float]]], floor_s: float) -> dict:
    """runs: (start, token times) per timed run -> medians over runs, TPOT percentiles over every gap."""
    ttft = [t[0] - start for start, t in runs]
    decode = [t[-1] - t[0] for _, t in runs]
    gaps = [b - a for _, t in runs for a, b in zip(t, t[1:])]
    n = len(runs[0][1])
    med = statistics.median(decode)
    return {"engine": engine, "decode_tok_s": (n - 1) / med if med > 0 else float("nan"),
            "ttft_ms": 1e3 * statistics.median(ttft), **percentiles(gaps, "tpot"),
            "e2e_ms": 1e3 * statistics.median(t[-1] - start for start, t in runs),
            "floor_tok_s": (n - 1) / floor_s, "pct_of_floor": 100 * floor_s / med if med > 0 else float("nan")}


def latency(model=None, *, input_len: int | None = None, output_len: int | None = None, num_iters: int = 3,
            num_iters_warmup: int = 1, seed: int = 0, hf: bool = True, device=None, json_path=None,
            progress: bool = True, quantization=None, tensor_parallel_size: int = 1, **engine_args) -> dict:
    """Batch-1 latency through LLMEngine and HF generate, against the weight-reading floor."""
    device = default_device() if device is None else torch.device(device)
    s = _sizes(LATENCY_SIZES, dict(input_len=input_len, output_len=output_len), device)
    check_int("input_len", s["input_len"])
    check_int("output_len", s["output_len"])
    if s["output_len"] < 2:
        raise ValueError(f"output_len must be >= 2 (decode speed is measured after the first token), not {output_len}")
    check_int("num_iters", num_iters)
    check_int("num_iters_warmup", num_iters_warmup, 0)
    models, config, procs = _load(model, device, quantization, engine_args, tensor_parallel_size, hf)
    if s["input_len"] + s["output_len"] > models.config.max_position_embeddings:
        raise ValueError(f"input_len + output_len = {s['input_len'] + s['output_len']} exceeds the model's "
                         f"context ({models.config.max_position_embeddings} tokens)")
    rng = random.Random(seed)
    prompts = [[rng.randrange(models.config.vocab_size) for _ in range(s["input_len"])]
               for _ in range(num_iters_warmup + num_iters)]  # a fresh prompt per run, the same for both
    info = header(f"latency: batch 1, {s['input_len']}-token prompt, {s['output_len']} new tokens (greedy, EOS "
                  f"ignored), median of {num_iters} runs after {num_iters_warmup} warm-up; {models.label}, "
                  f"{models.dtype_name}")
    floor_s = _decode_floor(models, s["input_len"], s["output_len"], info["copy_gbps"])

    engine, runs = _engine(models, config, progress, procs), []
    for i, prompt in enumerate(prompts):
        out = _run_all(engine, [(prompt, s["output_len"])], f"latency-{i}-", progress=False)[f"latency-{i}-0"]
        if len(out.outputs[0].token_ids) != s["output_len"]:
            raise RuntimeError(f"got {len(out.outputs[0].token_ids)} tokens, asked for exactly {s['output_len']}")
        if i >= num_iters_warmup:
            runs.append((out.metrics.arrival_time, out.metrics.token_times[0]))
    rows = [_latency_row("minillm", runs, floor_s)]
    free_engine(engine)
    if hf:
        hf_model, runs = hf_peer.load_hf(models.hf_source, models.dtype, device), []
        for i, prompt in enumerate(prompts):
            r = hf_peer.one_request(hf_model, prompt, s["output_len"], device)
            if i >= num_iters_warmup:
                runs.append((r["start"], r["token_times"]))
        rows.append(_latency_row("HF generate", runs, floor_s))
        del hf_model
    print_table(rows, ["engine", "decode_tok_s", "ttft_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_ms", "floor_tok_s",
                       "pct_of_floor"])
    ratio = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"] if hf else None
    if hf:
        print(f"minillm / HF decode tok/s: {ratio:.2f}x; TTFT HF / minillm: "
              f"{rows[1]['ttft_ms'] / rows[0]['ttft_ms']:.2f}x")
    shard = f" (rank 0's shard of {tensor_parallel_size})" if tensor_parallel_size > 1 else ""
    print(f"floor: {models.weight_bytes() / 1e6:.1f} MB of weights{shard} + {models.kv_bytes_per_token()} B of K/V per "
          f"cached token per step, at {info['copy_gbps']:.0f} GB/s measured copy bandwidth")
    result = {**info, "workload": "latency", "model": models.label, "dtype": models.dtype_name, "device": str(device),
              "tensor_parallel_size": tensor_parallel_size,
              "seed": seed, **s, "engine_config": {k: getattr(engine.config, k) for k in ENGINE_ARGS},
              "num_iters": num_iters, "num_iters_warmup": num_iters_warmup,
              "weight_bytes": models.weight_bytes(), "kv_bytes_per_token": models.kv_bytes_per_token(),
              "floor_s": floor_s, "minillm": rows[0], "hf": rows[1] if hf else None, "ratio": ratio,
              "ttft_ratio": rows[1]["ttft_ms"] / rows[0]["ttft_ms"] if hf else None}
    return _write(result, json_path)


def add_arguments(parser, workload: str) -> None:
    """`minillm bench throughput|latency` options (vLLM's benchmark names where they have one)."""
    p = parser
    p.add_argument("--model", default=None, help="a .gguf file, HF folder, or PRESET-dummy (e.g. qwen3-0.6b-dummy); "
                                                 "default: the embedded SmolLM2-135M")
    if workload == "throughput":
        p.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=None)
        for side in ("input", "output"):
            p.add_argument(f"--min-{side}-len", type=int, default=None)
            p.add_argument(f"--max-{side}-len", type=int, default=None)
        p.add_argument("--hf-batch-size", "--hf-max-batch-size", dest="hf_batch_size", type=int, default=None)
        p.add_argument("--hf-requests", type=int, default=None, help="run the HF peer on the first N requests only")
    else:
        p.add_argument("--input-len", type=int, default=None)
        p.add_argument("--output-len", type=int, default=None)
        p.add_argument("--num-iters", type=int, default=3)
        p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF generate peer")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False, default=None,
                   help="no overlap scheduling (chapter 13): the host waits for each step's tokens")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "cuda_graph_max_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks (chapter 11): one GPU each, or N CPU processes (gloo)")
    p.add_argument("--decode-backend", default=None, choices=["graphs", "pdl"],
                   help="decode steps: CUDA graphs of today's kernels, or our GEMV with programmatic dependent "
                        "launch inside the graphs (chapter 18; a Hopper GPU)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3", "int8"],
                   help="KV cache storage (chapter 08): fp8/int8 hold twice the tokens of bf16")
    p.add_argument("--enable-prefix-caching", type=_prefix_caching, default=None, help="off, hash or radix (chapter 06)")
    p.add_argument("--kv-offload-gb", type=float, default=None, help="GiB of pinned CPU memory that evicted prefix-cache "
                   "blocks spill to and come back from (chapter 15; needs --enable-prefix-caching)")
    p.add_argument("--kv-offload-blocks", type=int, default=None, help="the same tier counted in blocks (overrides GiB)")
    p.add_argument("--quantization", type=_quantization, default=None, help="weights in fewer bits: int8, int4, "
                   "awq, gptq (NAME:key=value,...), or a folder written by `minillm quantize` (chapter 08)")


def _prefix_caching(text: str):
    from ..entrypoints.openai.cli_args import _prefix_caching as parse

    return parse(text)


def _quantization(text: str):
    from ..quantize import parse_quantization

    return parse_quantization(text)


def run(**kwargs) -> dict:  # the registry's entry point: `minillm bench throughput` is the default
    return throughput(**kwargs)
