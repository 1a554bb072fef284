"""`minillm bench disagg`: one colocated engine against 1 prefill + 1 decode engine (chapter 17).

Three engine processes, spawned once and kept for every run: a colocated engine; a producer (prefills
each prompt with max_tokens=1 and keeps its K/V) and a consumer (loads the K/V and decodes), joined by
a KV connector (CudaIpcConnector on a GPU, SharedPoolConnector's shared memory on a CPU) and by a
queue that plays the router: the producer's finished request is the consumer's new one, the router's
two-phase request without HTTP. Each process records when each of its requests' tokens appeared
(time.monotonic, one clock for every process on Linux); the parent turns them into vllm bench serve's
numbers (serve_metrics.summarize): TTFT from arrival to the consumer's first token, TPOT, ITL.

Two workloads:
  rates  Poisson arrivals at each of --rates requests/s, --num-prompts random prompts each: TTFT, TPOT
         and ITL p50/p99, and goodput under the SLO (by default --slo-scale x the colocated engine's
         median TTFT and TPOT at the lowest rate, named in the output)
  burst  --burst-decodes long decodes run alone, then --burst-prompts long prompts arrive at once: the
         decodes' ITL p99 before the burst (decode-only) and during it, each engine setup

Greedy, so the disaggregated tokens must equal the colocated ones: counted per run ("tokens_equal";
on a CPU in fp32 they are identical; on a GPU in bf16 a different batch may round differently).
Be clear about what one device as two processes is: the two engines share its compute and memory
bandwidth (and on a CPU, its cores), so the prefill burst still slows the decode engine's steps; the
two-GPU claims of DistServe are for two GPUs. `--json` prints one JSON object.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import random
import tempfile
import time

from .serve_metrics import RequestResult, arrival_times, meets_slo, summarize, tpot, ttft

CPU = dict(preset=None, prompt=(16, 96), output=(8, 24), num_prompts=16, rates="4,8,16,32,64,128",
           burst_decodes=4, burst_output=96, burst_prompts=4, burst_prompt_len=192, max_batched=64)
GPU = dict(preset="qwen3-0.6b", prompt=(256, 2048), output=(64, 256), num_prompts=64, rates="2,4,8,16,32,64,128",
           burst_decodes=16, burst_output=1024, burst_prompts=16, burst_prompt_len=4096, max_batched=2048)


def tiny_config():
    from ..config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)


def build_engine(device: str, preset: str | None, max_batched: int, kv: dict | None):
    import torch

    from ..engine import EngineConfig, LLMEngine
    from ..loader import load_model
    from ..tokenizer import train_bpe
    from ..tokenizer.samples import FIXED

    if device == "cpu":
        torch.set_num_threads(1)  # two engines share the machine: one core each
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, _, _ = load_model(preset or tiny_config(), load_format="dummy", dtype=dtype, device=device)
    tok = train_bpe("\n".join(FIXED), vocab_size=300)  # (token ids are given; the tokenizer only detokenizes)
    config = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=max_batched,
                          num_gpu_blocks=8192 if device == "cuda" else 2048, kv_transfer_config=kv)
    return LLMEngine(model, tok, [], config, progress=False)


def _params(max_tokens: int, handle: dict | None):
    from ..sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": handle} if handle else None)


def _serve(role: str, device: str, preset, max_batched: int, kv_path: str | None, cmds, results, handoff) -> None:
    """One engine process: runs each schedule it is sent, reports every request's token times."""
    kv = None
    if role != "colocated":
        kv = {"kv_connector": "CudaIpcConnector" if device == "cuda" else "SharedPoolConnector",
              "kv_role": role, "kv_path": kv_path, "kv_load_timeout": 300.0, "kv_send_timeout": 300.0}
    try:
        engine = build_engine(device, preset, max_batched, kv)
        results.put(("ready", role))
        while (cmd := cmds.get()) is not None:
            schedule, t0, tag = cmd
            results.put((role, tag, _run(engine, role, schedule, t0, tag, handoff)))
        engine.shutdown()
    except Exception:  # the parent waits on the queue: tell it, rather than leave it waiting
        import traceback

        results.put(("error", f"the {role} engine failed:\n{traceback.format_exc()}"))


def _run(engine, role: str, schedule: list, t0: float, tag: str, handoff) -> dict:
    """schedule: [(arrival_s, prompt_ids, max_tokens)]; -> {i: (token_ids, token times)}."""
    pending = sorted(range(len(schedule)), key=lambda i: schedule[i][0]) if role != "consumer" else []
    times: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    seen: dict[int, int] = {}
    waiting_for = len(schedule)
    while waiting_for:
        now = time.monotonic()
        while pending and t0 + schedule[pending[0]][0] <= now:  # arrivals that are due
            i = pending.pop(0)
            _, prompt, n = schedule[i]
            handle = {"do_remote_decode": True, "transfer_id": f"{tag}-{i}"} if role == "producer" else None
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, _params(1 if handle else n, handle))
        if role == "consumer":  # the router's second phase: the producer is done with these
            while True:
                try:
                    i = handoff.get_nowait()
                except queue.Empty:
                    break
                _arrival, prompt, n = schedule[i]
                engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt},
                                   _params(n, {"do_remote_prefill": True, "transfer_id": f"{tag}-{i}"}))
        if not engine.has_unfinished_requests():
            time.sleep(0.0005 if role == "consumer" else max(0.0, min(0.005, t0 + schedule[pending[0]][0] - now))
                       if pending else 0.0005)
            continue
        outs = engine.step()
        stamp = time.monotonic()
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            ids = out.outputs[0].token_ids if out.outputs else []
            if len(ids) > seen.get(i, 0):
                seen[i] = len(ids)
                times.setdefault(i, []).append(stamp)
                tokens[i] = list(ids)
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{role}: request {out.request_id} failed: {out.error}")
                waiting_for -= 1
                if role == "producer":
                    handoff.put(i)
        if not outs and role == "producer":
            time.sleep(0.0005)  # holding blocks for the consumer: let the other engine have the device
    while engine.has_unfinished_requests():  # a producer: until the consumer has taken every transfer
        engine.step()
        time.sleep(0.0005)
    return {i: (tokens.get(i, []), times.get(i, [])) for i in range(len(schedule))}


class Cluster:
    """The three engine processes (spawned once), and one schedule run through either setup."""

    def __init__(self, device: str, preset, max_batched: int):
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.results, handoff = ctx.Queue(), ctx.Queue()
        self.cmds = {r: ctx.Queue() for r in ("colocated", "producer", "consumer")}
        self.procs = [ctx.Process(target=_serve, daemon=True, args=(r, device, preset, max_batched,
                                                                   os.path.join(self._tmp.name, "kv"), self.cmds[r],
                                                                   self.results, handoff))
                      for r in self.cmds]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._get()

    def _get(self, timeout: float = 600.0):
        got = self.results.get(timeout=timeout)
        if got[0] == "error":
            raise RuntimeError(got[1])
        return got

    def run(self, setup: str, schedule: list, tag: str) -> tuple[dict, float]:
        """-> ({i: (tokens, times)}, t0): the consumer's tokens for the disaggregated setup."""
        roles = ["colocated"] if setup == "colocated" else ["producer", "consumer"]
        t0 = time.monotonic() + 0.2
        for r in roles:
            self.cmds[r].put((schedule, t0, tag))
        got = {}
        for _ in roles:
            role, _, res = self._get()
            got[role] = res
        return got["colocated" if setup == "colocated" else "consumer"], t0

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()


def results_of(schedule: list, got: dict, t0: float) -> list[RequestResult]:
    out = []
    for i, (arrival, prompt, n) in enumerate(schedule):
        ids, stamps = got[i]
        out.append(RequestResult(start=t0 + arrival, chunk_times=stamps, output_tokens=len(ids),
                                 prompt_tokens=len(prompt), success=len(ids) == n))
    return out


def poisson_schedule(rate: float, num: int, sizes: dict, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [(t, [rng.randrange(vocab) for _ in range(rng.randint(*sizes["prompt"]))], rng.randint(*sizes["output"]))
            for t in arrival_times(num, rate, seed=seed)]


def burst_schedule(sizes: dict, vocab: int, seed: int, burst_at: float) -> list:
    """burst_decodes decodes at t = 0 (short prompts, long outputs), then burst_prompts long prompts at
    burst_at (one output token each: their prefill is the load)."""
    rng = random.Random(seed)
    dec = [(0.0, [rng.randrange(vocab) for _ in range(16)], sizes["burst_output"])
           for _ in range(sizes["burst_decodes"])]
    burst = [(burst_at, [rng.randrange(vocab) for _ in range(sizes["burst_prompt_len"])], 2)
             for _ in range(sizes["burst_prompts"])]
    return dec + burst


def burst_itl(schedule: list, got: dict, t0: float, num_decodes: int) -> dict:
    """The decodes' ITL p99 (ms) with no prefill running (before the burst) and during the burst (an
    interval that overlaps [burst arrival, the burst's last first token])."""
    import numpy as np

    start = t0 + schedule[num_decodes][0]
    end = max(got[i][1][0] for i in range(num_decodes, len(schedule)))
    alone, during = [], []
    for i in range(num_decodes):
        stamps = got[i][1]
        for a, b in zip(stamps, stamps[1:]):
            if b <= start:
                alone.append(b - a)
            elif a < end:
                during.append(b - a)

    def p99(xs):
        return float(np.percentile(np.asarray(xs) * 1e3, 99)) if xs else float("nan")

    return {"itl_p99_decode_only_ms": p99(alone), "itl_p99_during_burst_ms": p99(during),
            "ratio": p99(during) / p99(alone), "gaps_decode_only": len(alone), "gaps_during_burst": len(during)}


def run(device: str | None = None, rates: str | None = None, num_prompts: int | None = None, slo: str | None = None,
        slo_scale: float = 5.0, seed: int = 0, json_out: bool = False, workloads: str = "rates,burst",
        cluster: Cluster | None = None) -> dict:
    """Both workloads on both setups; cluster: engine processes already started (a notebook's), kept open."""
    import torch

    from ..hw import device_name

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = dict(GPU if device == "cuda" else CPU)
    rate_list = [float(r) for r in (rates or sizes["rates"]).split(",")]
    num = num_prompts or sizes["num_prompts"]
    vocab = 512 if sizes["preset"] is None else 32000
    report = {"device": device_name(torch.device(device)), "date": time.strftime("%Y-%m-%d"),
              "model": sizes["preset"] or "tiny llama (dummy weights, fp32)",
              "connector": "CudaIpcConnector" if device == "cuda" else "SharedPoolConnector",
              "setup": "1 device, 2 processes (producer + consumer) vs 1 colocated process; not two devices: "
                       "both engines share the device's compute and bandwidth", "rates": [], "burst": None}
    t_start = time.perf_counter()
    own = cluster is None
    cluster = cluster or Cluster(device, sizes["preset"], sizes["max_batched"])
    try:
        warm = poisson_schedule(math.inf, 4, sizes, vocab, seed + 99)
        for setup in ("colocated", "disagg"):
            cluster.run(setup, warm, f"warm{setup}")
        slo_ms = None if slo is None else tuple(float(x) for x in slo.split(","))
        if "rates" in workloads:
            for k, rate in enumerate(rate_list):
                schedule = poisson_schedule(rate, num, sizes, vocab, seed + k)
                row, toks = {"rate": rate}, {}
                for setup in ("colocated", "disagg"):
                    got, t0 = cluster.run(setup, schedule, f"r{k}{setup[0]}")
                    res = results_of(schedule, got, t0)
                    duration = max(s for _, st in got.values() for s in st) - t0
                    if slo_ms is None:  # the SLO: slo_scale x the colocated engine unloaded (the lowest rate)
                        base = summarize(res, duration)
                        slo_ms = (slo_scale * base["median_ttft_ms"], slo_scale * base["median_tpot_ms"])
                    s = summarize(res, duration, slo_ms)
                    row[setup] = {key: s[key] for key in ("completed", "duration_s", "request_throughput",
                                                          "output_throughput", "goodput", "median_ttft_ms",
                                                          "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                                                          "median_itl_ms", "p99_itl_ms")}
                    row[setup]["slo_attained"] = sum(
                        meets_slo(ttft(r.start, r.chunk_times), tpot(r.start, r.chunk_times, r.num_output_tokens),
                                  slo_ms) for r in res if r.success) / len(res)
                    toks[setup] = [got[i][0] for i in range(len(schedule))]
                row["tokens_equal"] = sum(a == b for a, b in zip(toks["colocated"], toks["disagg"]))
                row["requests"] = len(schedule)
                report["rates"].append(row)
            report["slo"] = {"ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1],
                             "rule": "given (--slo)" if slo else f"{slo_scale} x the colocated median TTFT and "
                                     f"TPOT at {rate_list[0]} req/s"}
        if "burst" in workloads:
            schedule = burst_schedule(sizes, vocab, seed + 7, burst_at=0.3 if device == "cpu" else 0.1)
            report["burst"] = {"decodes": sizes["burst_decodes"], "prompts": sizes["burst_prompts"],
                               "prompt_len": sizes["burst_prompt_len"]}
            toks = {}
            for setup in ("colocated", "disagg"):
                got, t0 = cluster.run(setup, schedule, f"b{setup[0]}")
                report["burst"][setup] = burst_itl(schedule, got, t0, sizes["burst_decodes"])
                toks[setup] = [got[i][0] for i in range(len(schedule))]
            report["burst"]["tokens_equal"] = sum(a == b for a, b in zip(toks["colocated"], toks["disagg"]))
    finally:
        if own:
            cluster.close()
    report["wall_s"] = time.perf_counter() - t_start
    if json_out:
        print(json.dumps(report))
    else:
        print_report(report)
    if path := os.environ.get("MINILLM_BENCH_JSON"):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def print_report(r: dict) -> None:
    print(f"{r['device']}, {r['model']}, {r['connector']}; {r['setup']}")
    if r["rates"]:
        s = r["slo"]
        print(f"SLO: TTFT <= {s['ttft_ms']:.1f} ms and TPOT <= {s['tpot_ms']:.1f} ms ({s['rule']})")
        print(f"{'req/s':>6} {'setup':>9} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'ITL p99':>8} "
              f"{'goodput':>8} {'in SLO':>7} {'tokens =':>9}")
        for row in r["rates"]:
            for setup in ("colocated", "disagg"):
                x = row[setup]
                eq = f"{row['tokens_equal']}/{row['requests']}" if setup == "disagg" else ""
                print(f"{row['rate']:>6g} {setup:>9} {x['median_ttft_ms']:>9.1f} {x['p99_ttft_ms']:>8.1f} "
                      f"{x['median_tpot_ms']:>9.2f} {x['p99_tpot_ms']:>8.2f} {x['p99_itl_ms']:>8.2f} "
                      f"{x['goodput']:>8.2f} {x['slo_attained']:>7.0%} {eq:>9}")
    if b := r["burst"]:
        print(f"prefill burst: {b['decodes']} decodes, then {b['prompts']} prompts of {b['prompt_len']} tokens")
        for setup in ("colocated", "disagg"):
            x = b[setup]
            print(f"  {setup:>9}: ITL p99 {x['itl_p99_decode_only_ms']:.2f} ms decode-only, "
                  f"{x['itl_p99_during_burst_ms']:.2f} ms during the burst ({x['ratio']:.2f}x)")
        print(f"  tokens equal: {b['tokens_equal']}/{b['decodes'] + b['prompts']}")
    print(f"wall {r['wall_s']:.1f} s")


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    parser.add_argument("--rates", default=None, help="request rates, comma-separated (default: 6-7 per device)")
    parser.add_argument("--num-prompts", dest="num_prompts", type=int, default=None, help="requests per rate")
    parser.add_argument("--slo", default=None, help="'ttft_ms,tpot_ms' (default: --slo-scale x the colocated "
                        "engine's median at the lowest rate)")
    parser.add_argument("--slo-scale", dest="slo_scale", type=float, default=5.0)
    parser.add_argument("--workloads", default="rates,burst", help="rates, burst or both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", action="store_true", help="print one JSON object")
