"""All-reduce time against message size, eager and inside a CUDA graph, with an alpha-beta fit.

    python3 -m torch.distributed.run --nproc-per-node 2 scripts/gpu/allreduce_sweep.py --json $OUT/allreduce-nccl.json
    ... --backend gloo        gloo on CUDA tensors (what one GPU allows; no graphs): the slow baseline
    ... --backend gloo --device cpu --max-sizes 6     a dry run of this script on a CPU (CI's machine)

Every rank runs the same sweep through minillm.distributed (the group the layers use); rank 0 prints
the table and writes the JSON: per size the median time per all-reduce (CUDA events over a loop of
them, median of repeats), the algorithm and bus bandwidths (n / t and 2 (p - 1) / p * n / t, as
nccl-tests reports them), and alpha, beta fitted to the eager and the graphed times (cost_model.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from minillm.distributed import destroy_distributed_environment, get_tp_group, init_distributed_environment
from minillm.distributed.cost_model import fit_alpha_beta

SIZES = [8 * 1024 * 2**i for i in range(14)]  # 8 KB ... 64 MB


def _time_loop(fn, iters: int, repeats: int, cuda: bool) -> float:
    """Median over repeats of (one loop of `iters` calls) / iters, in seconds: CUDA events on a GPU,
    the host clock on a CPU (where the collective is synchronous)."""
    times = []
    for _ in range(repeats):
        get_tp_group().barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(iters)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            fn(iters)
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def check_sum(group, device) -> None:
    """The sweep measures a correct all-reduce: random inputs, known sum (integers: exact in fp32)."""
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randint(-1000, 1000, (4097,), generator=g).float() for _ in range(group.world_size)]
    y = group.all_reduce(xs[group.rank].clone().to(device))
    if not torch.equal(y.cpu(), sum(xs)):
        raise AssertionError("all-reduce gave a wrong sum")


def measure(x: torch.Tensor, group, iters: int, repeats: int, graphed: bool):
    """-> (eager seconds per all-reduce, graphed seconds or None, the capture's error or None)."""
    def loop(k):
        for _ in range(k):
            dist.all_reduce(x, group=group.device_group)

    cuda = x.is_cuda
    for _ in range(5):  # warm the communicator and its algorithm choice for this size (before any capture)
        group.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    eager = _time_loop(loop, iters, repeats, cuda)
    if not graphed:
        return eager, None, None
    try:  # a graph of `iters` all-reduces, replayed: the launches are gone, the transfers stay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop(iters)
        graph.replay()
        torch.cuda.synchronize()
        return eager, _time_loop(lambda k: graph.replay(), 1, repeats, cuda) / iters, None
    except RuntimeError as e:  # keep the eager sweep; say why the graphed one is missing
        return eager, None, f"{type(e).__name__}: {e}"


def sweep(args) -> dict:
    group = get_tp_group()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    check_sum(group, device)
    rows, graph_error = [], None
    for n in SIZES[: args.max_sizes]:
        x = torch.zeros(n // dtype.itemsize, dtype=dtype, device=device)  # values do not change the time
        iters = args.iters or (50 if n >= 8 * 2**20 else 200)
        row = {"bytes": n}
        row["eager_s"], row["graph_s"], err = measure(x, group, iters, args.repeats,
                                                      args.backend == "nccl" and device.type == "cuda" and not graph_error)
        if row["graph_s"] is None:
            del row["graph_s"]
        if err:
            graph_error = err
            print(f"CUDA graph capture failed: {err}", flush=True)
        p = group.world_size
        for mode in ("eager", "graph"):
            if f"{mode}_s" in row:
                t = row[f"{mode}_s"]
                row[f"{mode}_algbw_GBps"] = n / t / 1e9
                row[f"{mode}_busbw_GBps"] = 2 * (p - 1) / p * n / t / 1e9
        rows.append(row)
        if group.rank == 0:
            line = f"{n / 1024:>10.0f} KB  eager {row['eager_s'] * 1e6:9.1f} us  bus {row['eager_busbw_GBps']:7.1f} GB/s"
            if "graph_s" in row:
                line += f"   graph {row['graph_s'] * 1e6:9.1f} us  bus {row['graph_busbw_GBps']:7.1f} GB/s"
            print(line, flush=True)
    fits = {}
    for mode in ("eager", "graph"):
        pts = [(r["bytes"], r[f"{mode}_s"]) for r in rows if f"{mode}_s" in r]
        if not pts:
            continue
        for algorithm in ("ring", "one_shot"):
            try:
                ab = fit_alpha_beta([b for b, _ in pts], [t for _, t in pts], group.world_size, algorithm)
                worst = max(abs(ab.allreduce_time(b, group.world_size) / t - 1) for b, t in pts)
                fits[f"{mode}_{algorithm}"] = {"alpha_us": ab.alpha * 1e6, "beta_GBps": ab.beta / 1e9,
                                               "worst_rel_err": worst}
            except ValueError as e:
                fits[f"{mode}_{algorithm}"] = {"error": str(e)}
    return {"rows": rows, "fits": fits, "graph_error": graph_error}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MINILLM_COMMIT", "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-sizes", type=int, default=len(SIZES), help="only the first N sizes (gloo is slow)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run with gloo")
    ap.add_argument("--iters", type=int, default=0, help="all-reduces per timed loop (default 200, 50 from 8 MB)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("allreduce_sweep measures GPUs: no CUDA device here (--device cpu for a dry run)")
    if args.device == "cpu" and args.backend == "nccl":
        raise SystemExit("NCCL needs CUDA tensors: use --backend gloo with --device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    init_distributed_environment(backend=args.backend, local_rank=local_rank, timeout_s=120)
    try:
        result = sweep(args)
        group = get_tp_group()
        if group.rank == 0:
            result["meta"] = {
                "backend": args.backend, "dtype": args.dtype, "world_size": group.world_size,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": _commit(),
                "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))},
            }
            print(json.dumps(result["fits"], indent=1))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    finally:
        destroy_distributed_environment()


if __name__ == "__main__":
    main()
