"""Why does the served engine step more often than LLM.generate on the same requests? (chapter 12)

    python scripts/serve_steps_cpu.py                          # 2-core CPU: emulated 0.5 ms + 3 us/token step
    python scripts/serve_steps_cpu.py --profile                # + cProfile of the API process, the engine core, offline
    python scripts/serve_steps_cpu.py --device cuda --emulate ""   # the GPU: the embedded SmolLM2, a real step

serve_overhead's measurement (the same 384 requests at rate inf, served by `minillm serve` with the
engine core in its own process, then through LLM.generate in a process of its own), with every
engine's steps traced by scripts/serve_steps/sitecustomize.py: each step's wall time and CPU, its
decoding sequences and prompt chunks with their tokens, running and waiting, and when each request
reached the engine core, against when the client sent it. It prints where the served run's extra
steps are: while the burst is still reaching the core (the intake ramp), after it, and why; and
what the API process's event loop spent per request while taking the burst in (intake: until its
last request left for the core) and then per 1000 tokens while streaming.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import os
import pstats
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# requests the server finishes before the burst: serve_overhead.served_run's warm-up (4, after
# run_requests' probe of its own) and the burst's probe
WARM = 6


def traced_env(trace: Path, emulate: str, profile: bool, send_per_pass: bool, burst: int) -> None:
    """Every Python process started from now on (server, engine core, client, offline) traces its steps;
    the server's event loop stamps its CPU at the end of the warm-up and of the burst's intake."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "serve_steps"), os.environ.get("PYTHONPATH")]))
    os.environ["MINILLM_STEP_TRACE_DIR"] = str(trace)
    os.environ.pop("MINILLM_EMULATE_STEP_US", None)
    os.environ["MINILLM_API_PHASES"] = f"{WARM},{burst}"
    os.environ["MINILLM_CLIENT_WIRE"] = "1"  # the client stamps its connections and writes
    if emulate:
        os.environ["MINILLM_EMULATE_STEP_US"] = emulate
    for name, on in (("MINILLM_CORE_PROFILE", profile), ("MINILLM_SEND_PER_PASS", send_per_pass)):
        os.environ.pop(name, None)
        if on:
            os.environ[name] = "1"


def run_once(model, device, reqs, work: Path, flags: list[str]) -> dict:
    """serve_overhead.measure, keeping what it throws away: every request's send time."""
    from minillm.bench.serve_metrics import summarize
    from minillm.bench.serve_overhead import offline_run, served_run

    results, duration, client_cpu, steps, cpu = served_run(model, device, reqs, work, None, flags)
    s = summarize(results, duration, (1e9, 1e9))
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        offline = pool.submit(offline_run, model, device, [(q.prompt, q.max_tokens) for q in reqs]).result()
    return dict(sends=sorted(r.start for r in results), served_s=s["duration_s"], served_tps=s["output_throughput"],
                ttft_ms=s["median_ttft_ms"], failed=s["failed"], steps=steps, offline=offline,
                output_tokens=s["total_output_tokens"], cpu=cpu, client_cpu=client_cpu)


def read_trace(trace: Path, role: str, since: float | None) -> dict:
    """The adds and steps of every process of one role; since: only those from then on (else the
    last busy period: the offline run's timed generate, after its warm-up)."""
    periods = [json.loads(line) for f in sorted(trace.glob(f"{role}-*.jsonl")) for line in f.read_text().splitlines()]
    if since is None:
        periods = periods[-1:]
    def pick(key):
        return sorted(x for p in periods for x in p.get(key, []) if since is None or x[0] >= since)

    return dict(adds=pick("adds"), steps=pick("steps"), publishes=pick("publishes"))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phases(tr: dict) -> list[tuple[str, list]]:
    """Steps split at two moments: the last request reaching the engine, and the waiting queue
    emptying after that (everyone admitted); the rest is the tail."""
    steps, last_add = tr["steps"], tr["adds"][-1][0]
    ramp = [s for s in steps if s[0] < last_add]
    rest = [s for s in steps if s[0] >= last_add]
    admitted = next((i for i, s in enumerate(rest) if s[8] == 0), len(rest))
    return [("intake (before the last request reached the engine)", ramp),
            ("after intake, some still waiting", rest[:admitted]), ("everyone admitted: the tail", rest[admitted:])]


def describe(name: str, tr: dict, t0: float, max_num_seqs: int, budget: int) -> dict:
    steps = [s for s in tr["steps"] if s[3] is not None]
    print(f"\n== {name}: {len(tr['steps'])} steps ({len(steps)} scheduled something) in "
          f"{tr['steps'][-1][1] - t0:.2f} s from the first send")
    full = next((i for i, s in enumerate(steps) if s[7] >= max_num_seqs), None)
    print(f"  steps before the running batch first reached max_num_seqs={max_num_seqs}: "
          f"{full if full is not None else 'never'}" + (f" (at {steps[full][0] - t0:.3f} s)" if full is not None else ""))
    print(f"  steps whose token budget ({budget}) was spent whole: {sum(s[4] + s[6] >= budget for s in steps)}")
    print(f"  {'phase':<54} {'steps':>5} {'seconds':>7} {'decode seqs':>11} {'prompt seqs':>11} "
          f"{'prompt tok':>10} {'running':>7} {'waiting':>7} {'ms/step':>7} {'CPU ms':>6}")
    out = {}
    for label, ph in phases(dict(tr, steps=steps)):
        if not ph:
            print(f"  {label:<54} {0:>5}")
            continue
        mean = [statistics.fmean(s[i] for s in ph) for i in range(9)]  # of each field of the step records
        row = dict(steps=len(ph), seconds=ph[-1][1] - ph[0][0], decode_seqs=mean[3], prompt_seqs=mean[5],
                   prompt_tokens=mean[6], running=mean[7], waiting=mean[8],
                   ms_per_step=1e3 * statistics.fmean(s[1] - s[0] for s in ph), cpu_ms=1e3 * mean[2])
        out[label] = row
        print(f"  {label:<54} {row['steps']:>5} {row['seconds']:>7.2f} {row['decode_seqs']:>11.1f} "
              f"{row['prompt_seqs']:>11.1f} {row['prompt_tokens']:>10.0f} {row['running']:>7.1f} "
              f"{row['waiting']:>7.1f} {row['ms_per_step']:>7.2f} {row['cpu_ms']:>6.2f}")
    tenths = [[s[3] for s in steps[i * len(steps) // 10:(i + 1) * len(steps) // 10]] for i in range(10)]
    deciles = [statistics.fmean(d) if d else float("nan") for d in tenths]  # a run under ten steps has empty tenths
    print("  decoding sequences per step, by tenth of the run's steps: " + " ".join(f"{d:.0f}" for d in deciles))
    return dict(steps=len(tr["steps"]), scheduled_steps=len(steps), full_batch_step=full, phases=out, deciles=deciles)


def wire(trace: Path, t0: float) -> dict[str, list[float]]:
    """The sitecustomize's stamps on the wire, seconds after the first send (the warm-up's dropped):
    the client's connections open and requests written, the server's connections accepted and
    requests parsed."""
    out = {}
    for side, keys in (("client", ("connected", "written")), ("api", ("accepted", "parsed"))):
        files = sorted(trace.glob(f"wire-{side}-*.json"))
        stamps = json.loads(files[-1].read_text()) if files else {}
        for k in keys:
            out[k] = sorted(s - t0 for s in stamps.get(k, []) if s >= t0)
    return out


def intake(r: dict, core: dict, trace: Path) -> dict:
    """When the burst left the client, went on the wire, reached the API process and the engine core."""
    t0, adds = r["sends"][0], core["adds"]
    api = [a[1] - t0 for a in adds if a[1] is not None]
    at_core = [a[0] - t0 for a in adds]
    sends = [t - t0 for t in r["sends"]]
    first_step = core["steps"][0][0] - t0
    w = wire(trace, t0)
    print(f"\n== intake of {len(sends)} requests, seconds after the client's first send")
    rows = (("client sent (its coroutine began)", sends), ("client: connection open", w["connected"]),
            ("client: request written", w["written"]), ("server accepted a connection", w["accepted"]),
            ("server parsed a request", w["parsed"]), ("API process took it in (arrival)", api),
            ("reached the engine core", at_core))
    for label, xs in ((label, xs) for label, xs in rows if xs):
        print(f"  {label:<34} p0 {pct(xs, 0):.3f}  p10 {pct(xs, .1):.3f}  p50 {pct(xs, .5):.3f}  "
              f"p90 {pct(xs, .9):.3f}  p100 {pct(xs, 1):.3f}")
    lag = [a[0] - a[1] for a in adds if a[1] is not None]
    print(f"  API -> core, per request (ms): p50 {1e3 * pct(lag, .5):.2f}  p90 {1e3 * pct(lag, .9):.2f}  "
          f"max {1e3 * max(lag):.2f}")
    steps_before = sum(s[0] < adds[-1][0] for s in core["steps"])
    print(f"  the core's first step began at {first_step:.3f} s; {steps_before} steps ran before the last "
          f"request reached it")
    return dict(send_p100=pct(sends, 1), api_p50=pct(api, .5), api_p100=pct(api, 1), core_p50=pct(at_core, .5),
                core_p100=pct(at_core, 1), steps_before_last_add=steps_before,
                wire={k: [pct(xs, q) for q in (0, .1, .5, .9, 1)] for k, xs in w.items() if xs})


def cpu_split(r: dict, core: dict, offline: dict) -> None:
    """Where each engine process's CPU went, in ms per 1000 output tokens: inside LLMEngine.step (the
    stepping thread), making the rows (the core's _publish), and the rest (the core's reader and writer
    threads: unpickling commands, pickling rows; the loop around; interpreter-lock hand-offs)."""
    k = 1e6 / r["output_tokens"]
    steps, pub = sum(s[2] for s in core["steps"]), sum(p[1] for p in core["publishes"])
    off_steps = sum(s[2] for s in offline["steps"])
    print(f"\n== CPU ms per 1000 output tokens: engine core process {k * r['cpu']['core']:.1f} = steps "
          f"{k * steps:.1f} + rows (_publish) {k * pub:.1f} + the rest {k * (r['cpu']['core'] - steps - pub):.1f}; "
          f"offline process {k * r['offline']['cpu_s']:.1f} = steps {k * off_steps:.1f} + the rest "
          f"{k * (r['offline']['cpu_s'] - off_steps):.1f}")
    print(f"  per step: core {1e3 * steps / len(core['steps']):.2f} ms in the step + {1e3 * pub / len(core['steps']):.2f} "
          f"ms of rows; offline {1e3 * off_steps / len(offline['steps']):.2f} ms")


def api_phases(trace: Path, t0: float, burst: int, tokens: int) -> dict:
    """The API process's event loop: its thread's CPU while it took the burst in (from the warm-up's
    end to the last request leaving for the core; the idle gap before the burst costs ~nothing) and
    while it streamed the rest, from the stamps of sitecustomize's MINILLM_API_PHASES."""
    files = sorted(trace.glob("api-*.json"))
    if not files:
        return {}
    warm, intake, stream = json.loads(files[-1].read_text())[:3]  # [phase, time, CPU, GC s, GC runs by generation]
    gc = [[b - a for a, b in zip(x[3:], y[3:])] for x, y in ((warm, intake), (intake, stream))]
    out = dict(intake_end_s=intake[1] - t0, intake_cpu_ms_per_request=1e3 * (intake[2] - warm[2]) / burst,
               intake_gc_ms_per_request=1e3 * gc[0][0] / burst, intake_gc_runs=gc[0][1:],
               stream_cpu_ms_per_1000_tokens=1e6 * (stream[2] - intake[2]) / tokens,
               stream_gc_ms_per_1000_tokens=1e6 * gc[1][0] / tokens, stream_gc_runs=gc[1][1:])
    print(f"\n== API process, event loop thread: intake (until {out['intake_end_s']:.3f} s) "
          f"{out['intake_cpu_ms_per_request']:.2f} ms CPU per request (garbage collection "
          f"{out['intake_gc_ms_per_request']:.2f} ms, runs by generation {gc[0][1:]}); then streaming "
          f"{out['stream_cpu_ms_per_1000_tokens']:.1f} ms CPU per 1000 output tokens (garbage collection "
          f"{out['stream_gc_ms_per_1000_tokens']:.1f} ms, runs {gc[1][1:]})")
    return out


def top_profile(path: Path, count: int, n: int = 18, unit: str = "step", by_cum: int = 0) -> None:
    """The top n functions by own time, in µs per `unit` (count of them); by_cum: that many more by
    cumulative time (the API process: which handler, middleware or parser the time is under)."""
    st = pstats.Stats(str(path))
    total, count = st.total_tt, max(count, 1)
    print(f"\n== cProfile {path.name}: {total:.2f} s of the main thread's time (sleeps included), "
          f"{1e3 * total / count:.2f} ms per {unit}; top {n} by own time, µs per {unit}")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]
    if by_cum:
        rows += [None] + sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:by_cum]
    for row in rows:
        if row is None:
            print(f"  -- top {by_cum} by cumulative time")
            continue
        (file, line, fn), (_, ncall, tt, ct, _) = row
        print(f"  {1e6 * tt / count:>8.0f} own {1e6 * ct / count:>8.0f} cum {ncall:>8}  {Path(file).name}:{line} {fn}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="default: as serve_overhead (CPU: a tiny random Llama)")
    p.add_argument("--emulate", default="500,3", help="MINILLM_EMULATE_STEP_US (BASE,PER_TOKEN); '' for a real step")
    p.add_argument("--num-prompts", type=int, default=384)
    p.add_argument("--input-len", type=int, nargs=2, default=(128, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    p.add_argument("--serve-args", default="--engine-core process")
    p.add_argument("--profile", action="store_true", help="cProfile the API process (intake, streaming), the "
                   "engine core and the offline run")
    p.add_argument("--send-per-pass", action="store_true", help="the before of the A/B: the API process "
                   "sends its commands to the core once per pass of its event loop, as before 2026-11-26")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    p.add_argument("--keep-trace", type=Path, default=None, help="copy the raw traces into this folder")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from minillm.bench.serve import random_workload
    from minillm.bench.serve_overhead import tiny_checkpoint
    from minillm.engine.config import EngineConfig

    cfg = EngineConfig()
    with tempfile.TemporaryDirectory(prefix="minillm-serve-steps-") as tmp:
        work, trace = Path(tmp), Path(tmp) / "trace"
        trace.mkdir()
        model = args.model or (str(tiny_checkpoint(work / "tiny")) if args.device == "cpu" else None)
        traced_env(trace, args.emulate, args.profile, args.send_per_pass, args.num_prompts)
        reqs = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed=12,
                               prompt_format="ids")
        r = run_once(model, args.device, reqs, work, shlex.split(args.serve_args))
        off = r["offline"]
        print(f"served {r['served_tps']:,.0f} tok/s in {r['served_s']:.2f} s (TTFT p50 {r['ttft_ms']:.0f} ms, "
              f"{r['failed']} failed), offline {off['output_tokens'] / off['seconds']:,.0f} tok/s in "
              f"{off['seconds']:.2f} s: {100 * r['served_tps'] * off['seconds'] / off['output_tokens']:.0f} %; "
              f"engine steps {r['steps']:.0f} served (/metrics), {off['steps']} offline; {r['output_tokens']} tokens")
        k = 1e6 / off["output_tokens"]
        print(f"CPU ms per 1000 output tokens: API loop {k * r['cpu']['loop']:.0f}, core {k * r['cpu']['core']:.0f}, "
              f"client {k * r['client_cpu']:.0f}, offline {k * off['cpu_s']:.0f}")
        core = read_trace(trace, "core", r["sends"][0])
        offline = read_trace(trace, "offline", None)
        res = dict(args={k: str(v) for k, v in vars(args).items()}, served_tps=r["served_tps"],
                   offline_tps=off["output_tokens"] / off["seconds"], served_steps=r["steps"],
                   offline_steps=off["steps"], ttft_ms=r["ttft_ms"], intake=intake(r, core, trace))
        res["served"] = describe("served (engine core)", core, r["sends"][0], cfg.max_num_seqs, cfg.max_num_batched_tokens)
        res["offline"] = describe("offline LLM.generate", offline, offline["adds"][0][0], cfg.max_num_seqs,
                                  cfg.max_num_batched_tokens)
        cpu_split(r, core, offline)
        res["api"] = api_phases(trace, r["sends"][0], args.num_prompts, r["output_tokens"])
        if args.profile:
            for phase in ("intake", "stream"):
                for f in sorted(trace.glob(f"api-*-{phase}.prof")):
                    top_profile(f, args.num_prompts, unit="request", by_cum=14)
            for f in sorted(trace.glob("core-*.prof")):
                top_profile(f, len(core["steps"]))
            for f in sorted(trace.glob("offline-*.prof")):
                top_profile(f, len(offline["steps"]))
        if args.json is not None:
            args.json.write_text(json.dumps(res, indent=1))
        if args.keep_trace is not None:
            args.keep_trace.mkdir(parents=True, exist_ok=True)
            for f in trace.iterdir():
                (args.keep_trace / f.name).write_bytes(f.read_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
