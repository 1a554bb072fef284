"""Chapter 18 on one H200, in <= 4 minutes: our split-K decode GEMV (kernels/gemv.py) vs cuBLAS at every
decode linear of SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B and Llama-3-8B, as % of the copy bandwidth
measured in the same run; a PDL race check; then batch-1 decode tok/s with decode_backend "graphs" vs
"pdl" (the embedded model in bf16, and dummy-weight SmolLM2 / Llama-3.2-1B shapes). Run from the repo
root with minillm installed (or on PYTHONPATH); no network, no model hub:

    OUT=/tmp/floor timeout 240 python3 scripts/gpu/floor_gemv.py   # MINILLM_MODEL: the embedded .gguf

Writes $OUT/floor_gemv.json after every section (a run cut short keeps what it measured) and prints
each row. BUDGET_S (default 215, from after the imports) bounds the run: a section that would start past it is skipped and
named in the JSON's "skipped".

Timing (as scripts/gpu/w4sweep.py): weight copies rotated so the set is >= 160 MB (three times the
50 MB L2: every call reads HBM, as a decode step does), the calls captured back to back in one CUDA
graph (launch cost included, no Python, and with PDL each launch overlaps the previous one's tail as in
a graphed step), µs per call = one replay / calls, median of 5 replays; 3 repeats alternating the
implementations, min / median / max of the repeats reported.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from minillm.hw import measure_copy_gbps
from minillm.kernels.gemv import gemv, gemv_config

T0 = time.monotonic()
BUDGET_S = float(os.environ.get("BUDGET_S", "215"))
OUT = Path(os.environ.get("OUT", "/tmp/floor"))
DEV = torch.device("cuda")
BF16 = torch.bfloat16
ROTATE_BYTES = 160e6
REPEATS = 3

# From each model's config.json: hidden, intermediate, heads, KV heads, head_dim, vocab.
MODELS = {
    "smollm2-135m": dict(hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, layers=30),
    "qwen3-0.6b": dict(hidden=1024, inter=3072, heads=16, kv_heads=8, head_dim=128, vocab=151936, layers=28),
    "llama-3.2-1b": dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256, layers=16),
    "llama-3-8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, layers=32),
}


def decode_linears(c: dict) -> list[dict]:
    """A decode layer's four projections (and the LM head), W [N, K], with the fusion each gets on the
    pdl backend: norm prologue (qkv, gate_up), residual epilogue (o, down), SiLU-mul (gate_up)."""
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    return [dict(op="qkv_proj", N=q + 2 * kv, K=c["hidden"], norm=True, res=False, silu=False),
            dict(op="o_proj", N=c["hidden"], K=q, norm=False, res=True, silu=False),
            dict(op="gate_up_proj", N=2 * c["inter"], K=c["hidden"], norm=True, res=False, silu=True),
            dict(op="down_proj", N=c["hidden"], K=c["inter"], norm=False, res=True, silu=False),
            dict(op="lm_head", N=c["vocab"], K=c["hidden"], norm=False, res=False, silu=False)]


RESULT: dict = {"skipped": [], "gemv": [], "race": None, "e2e": []}


def left() -> float:
    return BUDGET_S - (time.monotonic() - T0)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    RESULT["elapsed_s"] = round(time.monotonic() - T0, 1)
    (OUT / "floor_gemv.json").write_text(json.dumps(RESULT, indent=1))


def header() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return dict(gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(),
                commit=commit or os.environ.get("MINILLM_COMMIT", "unknown"))


def time_us(calls, repeats: int = 5) -> float:
    """Median over `repeats` graph replays of µs per call; calls[i] reads weight copy i."""
    for c in calls:  # compile, allocate the counters and workspaces' pool, outside the capture
        c()
    torch.cuda.synchronize()
    inner = max(32, len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(times)


def stats(xs: list[float]) -> dict:
    return dict(min=round(min(xs), 2), median=round(statistics.median(xs), 2), max=round(max(xs), 2))


def bench_shape(model: str, s: dict, M: int, copy_gbps: float, with_plain: bool) -> dict:
    N, K = s["N"], s["K"]
    n_out = N // 2 if s["silu"] else N
    nbytes = N * K * 2
    n = max(1, min(256, math.ceil(ROTATE_BYTES / nbytes)))
    ws = [torch.randn(N, K, device=DEV, dtype=BF16) * K**-0.5 for _ in range(n)]
    x = torch.randn(M, K, device=DEV, dtype=BF16)
    g = torch.randn(K, device=DEV, dtype=BF16) if s["norm"] else None
    r = torch.randn(M, n_out, device=DEV, dtype=BF16) if s["res"] else None
    fused = dict(norm_weight=g, residual=r, silu_mul=s["silu"])
    impls = {"torch": [lambda w=w: F.linear(x, w) for w in ws],
             "ours_pdl": [lambda w=w: gemv(x, w, **fused, pdl=True) for w in ws]}
    if with_plain:  # the same fused kernel without PDL: what PDL itself buys
        impls["ours"] = [lambda w=w: gemv(x, w, **fused) for w in ws]
    # correctness on this GPU first: ours (fused) vs the unfused ops through torch
    ref = F.linear(F.rms_norm(x.float(), (K,), g.float(), 1e-6).to(BF16) if g is not None else x, ws[0]).float()
    if s["silu"]:
        ref = F.silu(ref[:, :n_out]) * ref[:, n_out:]
    if r is not None:
        ref = ref + r.float()
    err = (gemv(x, ws[0], **fused, pdl=True).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    times: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(REPEATS):
        for name, calls in impls.items():
            times[name].append(time_us(calls))
    row = dict(model=model, op=s["op"], N=N, K=K, M=M, weight_mb=round(nbytes / 1e6, 2), copies=n,
               config=gemv_config(N, K, s["silu"]), rel_err=float(f"{err:.2e}"))
    for name, ts in times.items():
        row[name + "_us"] = stats(ts)
        row[name + "_pct_copy"] = round(100 * nbytes / (statistics.median(ts) * 1e-6) / (copy_gbps * 1e9), 1)
    row["speedup_vs_torch"] = round(statistics.median(times["torch"]) / statistics.median(times["ours_pdl"]), 3)
    print(f"{model:13s} {s['op']:13s} M={M} {N:6d}x{K:<6d} torch {row['torch_us']['median']:7.2f} µs "
          f"({row['torch_pct_copy']:5.1f} %)  ours+pdl {row['ours_pdl_us']['median']:7.2f} µs "
          f"({row['ours_pdl_pct_copy']:5.1f} %)" + (f"  ours {row['ours_us']['median']:7.2f}" if with_plain else "")
          + f"  err {err:.1e}", flush=True)
    del ws
    return row


def race_check() -> dict:
    """A chain h <- gemv(h, W_i, norm, + h) of 64 steps, each reading the previous one's output, in one
    graph: with PDL and without, bitwise. A gdc_wait placed after a read of x (or a counter reused
    before the previous launch ended) shows here as a different h."""
    K, steps = 2048, 64
    ws = [torch.randn(K, K, device=DEV, dtype=BF16) * K**-0.5 for _ in range(steps)]
    g = torch.randn(K, device=DEV, dtype=BF16)
    x0 = torch.randn(4, K, device=DEV, dtype=BF16)
    outs = {}
    for pdl in (False, True):
        h = x0.clone()

        def chain(h=h, pdl=pdl):
            y = h
            for w in ws:
                y = gemv(y, w, norm_weight=g, residual=y, pdl=pdl)
            h.copy_(y)
        chain()
        h.copy_(x0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        results = []
        for _ in range(5):
            h.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            results.append(h.clone())
        outs[pdl] = results
    same = all(torch.equal(a, outs[False][0]) for a in outs[False] + outs[True])
    print(f"PDL race check (64 dependent GEMVs in a graph, 5 replays each): bitwise equal = {same}", flush=True)
    return dict(steps=steps, K=K, M=4, bitwise_equal=same)


def e2e(label: str, model, backend: str) -> dict:
    from minillm.bench.serving import latency

    r = latency(model, hf=False, num_iters=2, num_iters_warmup=1, progress=False, decode_backend=backend,
                max_num_seqs=1, num_gpu_blocks=64)
    row = dict(model=label, decode_backend=backend, decode_tok_s=round(r["minillm"]["decode_tok_s"], 1),
               pct_of_floor=round(r["minillm"]["pct_of_floor"], 1), floor_tok_s=round(r["minillm"]["floor_tok_s"], 1),
               dtype=r["dtype"], copy_gbps=r.get("copy_gbps"))
    print(f"e2e {label:22s} {backend:6s} {row['decode_tok_s']:8.1f} tok/s ({row['pct_of_floor']} % of floor)", flush=True)
    return row


def same_tokens() -> dict:
    """The embedded model in bf16, greedy, 4 prompts x 48 tokens, decode_backend graphs vs pdl. Not
    bitwise by design (cuBLAS and our GEMV sum in other orders, bf16 rounds the difference), so the
    first position where they part is the result; a wrong PDL wait shows as garbage from token 1."""
    from minillm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("graphs", "pdl"):
        llm = LLM(dtype="bfloat16", decode_backend=backend, max_num_seqs=4, num_gpu_blocks=128)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        text = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].text
        del llm
        torch.cuda.empty_cache()
        print(f"{backend}: {prompts[0]!r} -> {text[:80]!r}", flush=True)
    parts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(tokens["graphs"], tokens["pdl"])]
    print(f"graphs vs pdl greedy tokens: first difference per prompt {parts} (None: all 48 equal)", flush=True)
    return dict(first_difference=parts, tokens=len(tokens["pdl"][0]), prompts=len(prompts))


def guarded(fn, model: str, s: dict, M: int, *args, **kw) -> dict:
    """One shape's row, or the error it raised (a compile failure must not end the run)."""
    try:
        return fn(model, s, M, *args, **kw)
    except Exception as e:
        print(f"{model} {s['op']} M={M} failed: {type(e).__name__}: {e}"[:600], flush=True)
        return dict(model=model, op=s["op"], N=s["N"], K=s["K"], M=M, error=f"{type(e).__name__}: {e}"[:600])


def main() -> None:
    RESULT["header"] = header()
    copy_gbps = statistics.median(measure_copy_gbps(DEV, 1 << 30) for _ in range(3))
    RESULT["copy_gbps"] = round(copy_gbps, 1)
    print(RESULT["header"], f"copy {copy_gbps:.0f} GB/s", flush=True)
    save()
    try:
        RESULT["race"] = race_check()
    except Exception as e:
        RESULT["race"] = dict(error=f"{type(e).__name__}: {e}"[:400])
    save()
    # op by op across the models (qkv of all four first, the LM heads last): a cut run still covers each model
    per_model = {m: decode_linears(c) for m, c in MODELS.items()}
    shapes = [(m, per_model[m][i]) for i in range(5) for m in MODELS]
    for M in (1,):  # batch 1 first: the headline; without-PDL only here
        for model, s in shapes:
            if left() < 140:
                RESULT["skipped"].append(f"gemv M={M} {model} {s['op']}")
                continue
            RESULT["gemv"].append(guarded(bench_shape, model, s, M, copy_gbps, with_plain=True))
            save()
    # end to end: graphs and pdl alternating, 3 repeats; the embedded model (bf16) and dummy shapes
    cases = [("embedded (bf16)", None), ("smollm2-135m-dummy", "smollm2-135m-dummy"),
             ("llama-3.2-1b-dummy", "llama-3.2-1b-dummy")]
    for rep in range(REPEATS):
        for label, model in cases:
            for backend in ("graphs", "pdl"):
                if left() < 40:
                    RESULT["skipped"].append(f"e2e {label} {backend} repeat {rep}")
                    continue
                try:
                    RESULT["e2e"].append(dict(e2e(label, model, backend), repeat=rep))
                except Exception as e:
                    RESULT["e2e"].append(dict(model=label, decode_backend=backend, repeat=rep,
                                              error=f"{type(e).__name__}: {e}"[:400]))
                    print("e2e", label, backend, "failed:", RESULT["e2e"][-1]["error"], flush=True)
                save()
    if left() > 30:
        try:
            RESULT["tokens"] = same_tokens()
        except Exception as e:
            RESULT["tokens"] = dict(error=f"{type(e).__name__}: {e}"[:400])
            print("token check failed:", RESULT["tokens"]["error"], flush=True)
        save()
    else:
        RESULT["skipped"].append("graphs vs pdl tokens")
    for M in (4, 8):
        for model, s in shapes:
            if left() < 8:
                RESULT["skipped"].append(f"gemv M={M} {model} {s['op']}")
                continue
            RESULT["gemv"].append(guarded(bench_shape, model, s, M, copy_gbps, with_plain=False))
            save()
    summary = {}
    for row in RESULT["e2e"]:
        if "decode_tok_s" in row:
            summary.setdefault(f"{row['model']} {row['decode_backend']}", []).append(row["decode_tok_s"])
    RESULT["e2e_summary"] = {k: stats(v) for k, v in summary.items()}
    for k, v in RESULT["e2e_summary"].items():
        print(f"{k:32s} tok/s min {v['min']} median {v['median']} max {v['max']}")
    save()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("floor_gemv.py needs a CUDA GPU")
    main()
