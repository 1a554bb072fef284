"""What the server costs: `minillm serve` vs `LLM.generate` on the very same requests (chapter 12).

    python -m minillm.bench.serve_overhead                       # a GPU: notebook 12's measurement (embedded model)
    python -m minillm.bench.serve_overhead --device cpu          # a tiny random model on the CPU
    python -m minillm.bench.serve_overhead --engine-core thread process --repeat 3   # both cores, 3 times each

The server runs in a subprocess (as in notebook 12); every request is sent at once (rate inf) as token
ids with ignore_eos, so the server's engine gets the same work `LLM.generate` gets, token for token.
Then the server stops and the offline engine runs the same list in a process of its own. The ratio of output
throughputs is what HTTP, JSON, SSE and the async loop cost.

On a CPU without --model, a 2-layer Llama of width 64 with SmolLM2's tokenizer (random weights) stands
in. Even so its step is long next to the server's work per token (the reference attention runs per
sequence in Python), where an H100's step is not, so on a CPU the ratio understates what the server
costs: compare the server's CPU time per 1000 output tokens, by thread, before and after a change
(printed too; steadier than wall time on a shared machine). With --profile DIR the server runs under yappi (every thread, CPU time) and writes its
top functions per thread to DIR/serve-profile.txt when it stops (pip install yappi).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch


def tiny_checkpoint(folder: Path) -> Path:
    """A Hugging Face folder: 2 Llama layers of width 64, SmolLM2's vocabulary, tokenizer and chat
    template, random weights (notebook 12's CPU stand-in)."""
    import torch
    import transformers

    from ..tokenizer.export import save_tokenizer_json
    from ..tokenizer.loaders import load_tokenizer

    tok = load_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok.vocab), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2048, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    save_tokenizer_json(tok, folder / "tokenizer.json")
    (folder / "chat_template.jinja").write_text(tok.chat_template)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model: str | None, device: str, log: Path, profile: Path | None, flags: list[str] = (),
           timeout: float = 300.0):
    """`minillm serve` in a subprocess on 127.0.0.1 (one intra-op thread on a CPU); yields its URL and
    pid. model None: the embedded one."""
    port = _free_port()
    serve = ["-m", "minillm", "serve", *(["--model", model] if model else []), "--device", device,
             "--port", str(port), "--no-access-log", "--log-level", "warning", *flags]
    if profile is not None:  # the same server, under yappi (it stops at SIGINT and writes its table)
        serve = ["-c", _PROFILED.format(out=str(profile / "serve-profile.txt")), *serve[3:]]
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if device == "cpu" else {})}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *serve], stdout=out, stderr=subprocess.STDOUT, env=env)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not healthy after {timeout} s")
            time.sleep(0.2)
        yield base, proc.pid
    finally:
        proc.send_signal(2)  # SIGINT: graceful, and the profiled server writes its table
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_PROFILED = """
import sys, yappi
from minillm.cli import main
yappi.set_clock_type("cpu")
yappi.start()
try:
    main(["serve", *sys.argv[1:]])
finally:
    yappi.stop()
    with open({out!r}, "w") as f:
        for t in yappi.get_thread_stats():
            f.write(f"=== thread {{t.name}} ({{t.ttot:.2f}} s)\\n")
            yappi.get_func_stats(ctx_id=t.id).sort("tsub").print_all(
                out=f, columns={{0: ("name", 90), 1: ("ncall", 9), 2: ("tsub", 8), 3: ("ttot", 8)}})
"""


def measure(model: str | None, device: str, num_prompts: int, input_len: tuple[int, int],
            output_len: tuple[int, int], work: Path, profile: Path | None = None, flags: list[str] = ()) -> dict:
    """-> output tokens/s served (rate inf) and offline on the same requests, and their ratio.

    Three processes besides the server: the client (aiohttp, bench/serve.py) and the offline
    `LLM.generate` each run in a spawned process of their own, so none shares a GIL with another
    side, and the offline engine's GPU memory is given back (its process ends) before the next
    server sizes its KV pool from what is free."""
    from .serve import random_workload
    from .serve_metrics import summarize

    reqs = random_workload(num_prompts, input_len, output_len, seed=12, prompt_format="ids")
    results, duration, client_cpu, steps, cpu = served_run(model, device, reqs, work, profile, flags)
    s = summarize(results, duration, (1e9, 1e9))
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {[r.error for r in results if r.error][:3]}")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        offline = pool.submit(offline_run, model, device, [(q.prompt, q.max_tokens) for q in reqs]).result()
    tokens = offline["output_tokens"]
    if tokens != s["total_output_tokens"]:
        raise RuntimeError(f"the server made {s['total_output_tokens']} tokens, LLM.generate {tokens}")
    return dict(requests=len(reqs), output_tokens=tokens, served_s=s["duration_s"],
                served_tps=s["output_throughput"], offline_s=offline["seconds"], offline_tps=tokens / offline["seconds"],
                ratio=s["output_throughput"] * offline["seconds"] / tokens, median_tpot_ms=s["median_tpot_ms"],
                median_ttft_ms=s["median_ttft_ms"], served_steps=steps, offline_steps=offline["steps"],
                offline_cpu_s=offline["cpu_s"], loop_cpu_s=cpu["loop"], other_cpu_s=cpu["other"],
                core_cpu_s=cpu["core"], client_cpu_s=client_cpu)


def served_run(model: str | None, device: str, reqs: list, work: Path, profile: Path | None = None,
               flags: list[str] = ()) -> tuple:
    """The served half of measure: a fresh server, 4 requests to warm it, then all of them at once.
    -> (results, seconds, the client's CPU seconds, engine steps, the server's CPU seconds by part)."""
    from .serve import run_requests_in_process

    with served(model, device, work / "serve.log", profile, flags) as (base, pid):
        run_requests_in_process(base, reqs[:4], ignore_eos=True, progress=False)  # warm
        steps, cpu = _engine_steps(base), _cpu_seconds(pid)
        results, duration, _, client_cpu = run_requests_in_process(base, reqs, ignore_eos=True, seed=12,
                                                                   progress=False, report_cpu=True)
        steps, cpu = _engine_steps(base) - steps, {k: v - cpu[k] for k, v in _cpu_seconds(pid).items()}
    return results, duration, client_cpu, steps, cpu


def offline_run(model: str | None, device: str, requests: list[tuple[list[int], int]]) -> dict:
    """LLM.generate on the requests (prompt ids, output length), greedy, ignore_eos, after a warm-up:
    -> output tokens, seconds, engine steps and this process's CPU seconds. Run in a process of its
    own (measure): when it returns, its engine's memory is the system's again."""
    import torch

    from ..llm import LLM
    from ..sampling import SamplingParams

    if device == "cpu":
        torch.set_num_threads(1)  # as the server ran: the same CPU for both
    llm = LLM(model, device=device)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    if llm.engine.sizes.device.type == "cuda":
        llm.engine.warm_up()  # compiled and captured, as the server was before /health said 200
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm
    steps = llm.engine.engine_stats.num_steps
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    return dict(output_tokens=sum(len(o.outputs[0].token_ids) for o in outs), seconds=seconds,
                steps=llm.engine.engine_stats.num_steps - steps, cpu_s=cpu)


def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server's main thread (the event loop), of its other threads
    (the engine's in thread mode, tokenizing workers') and of its child processes (the engine core in
    process mode), from /proc: less noisy than wall time on a busy machine."""
    out = {"loop": 0.0, "other": 0.0, "core": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        out["loop" if int(task.name) == pid else "other"] += _proc_cpu(task / "stat")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _stat_fields(proc / "stat")[1:2] == [str(pid)]:  # its parent is the server
            out["core"] += _proc_cpu(proc / "stat")
    return out


def _stat_fields(path: Path) -> list[str]:
    """/proc/.../stat after the command name: [state, ppid, ...]; [] if it is gone."""
    with contextlib.suppress(OSError):
        return path.read_text().rsplit(")", 1)[1].split()
    return []


def _proc_cpu(path: Path) -> float:
    fields = _stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def _engine_steps(base: str) -> float:
    """The server's engine steps so far (/metrics)."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("minillm_engine_steps_total "):
            return float(line.split()[1])
    raise RuntimeError("/metrics has no minillm_engine_steps_total")


def _report(r: dict, core: str) -> None:
    print(f"engine core {core}: {r['requests']} requests, {r['output_tokens']} output tokens: served "
          f"{r['served_tps']:,.0f} tok/s ({r['served_s']:.2f} s, TPOT p50 {r['median_tpot_ms']:.2f} ms), offline "
          f"{r['offline_tps']:,.0f} tok/s ({r['offline_s']:.2f} s): server / offline {100 * r['ratio']:.0f} %; engine "
          f"steps {r['served_steps']:.0f} served, {r['offline_steps']} offline (output tokens per step "
          f"{r['output_tokens'] / max(r['served_steps'], 1):.1f} served, {r['output_tokens'] / max(r['offline_steps'], 1):.1f} "
          f"offline)", flush=True)
    k = 1e6 / r["output_tokens"]  # CPU seconds -> ms per 1000 output tokens
    print(f"  CPU ms per 1000 output tokens: server event loop {k * r['loop_cpu_s']:.0f} + other threads (the "
          f"engine's in thread mode) {k * r['other_cpu_s']:.0f} + engine core process {k * r['core_cpu_s']:.0f}; "
          f"client {k * r['client_cpu_s']:.0f}; offline {k * r['offline_cpu_s']:.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: on a CPU a tiny random Llama with SmolLM2's "
                   "tokenizer, on a GPU the embedded SmolLM2")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--serve-args", default="", help="more `minillm serve` flags, in one string")
    # the defaults: on a GPU, notebook 12's workload (what chapter 12 quotes); on a CPU, one small
    # enough for a tiny model on two cores
    p.add_argument("--num-prompts", type=int, default=None, help="default: 384 on a GPU, 128 on a CPU")
    p.add_argument("--input-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt tokens, drawn uniformly (default: 128 512 on a GPU, 4 16 on a CPU)")
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="output tokens, drawn uniformly (default: 64 256 on a GPU, 48 64 on a CPU)")
    p.add_argument("--engine-core", nargs="+", choices=["thread", "process"], default=["process"],
                   help="measure the server with its engine core here (one after the other when several; "
                        "default: process, as `minillm serve`)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement here as a JSON list")
    p.add_argument("--repeat", type=int, default=1, help="measure this many times (a loaded machine is noisy)")
    p.add_argument("--profile", type=Path, default=None, help="a folder: profile the server with yappi there")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device != "cpu"
    args.num_prompts = args.num_prompts or (384 if gpu else 128)
    args.input_len = args.input_len or ((128, 512) if gpu else (4, 16))
    args.output_len = args.output_len or ((64, 256) if gpu else (48, 64))
    with tempfile.TemporaryDirectory(prefix="minillm-serve-overhead-") as tmp:
        work = Path(tmp)
        model = args.model or (str(tiny_checkpoint(work / "tiny")) if args.device == "cpu" else None)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        results = []
        for _ in range(args.repeat):
            for core in args.engine_core:
                r = measure(model, args.device, args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                            work, args.profile, ["--engine-core", core, *shlex.split(args.serve_args)])
                results.append(dict(engine_core=core, **r))
                _report(r, core)
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
