# ruff: noqa: B023  (benchmark closures are timed at once, inside their loop)
"""W4A16 vs cuBLAS bf16 on Llama-3-8B's linear shapes at M = 1, 4, 16 (chapter 08), and the ablations.

Per shape and M: cuBLAS bf16 (F.linear), minillm's int4 g128 as w4a16_gemm runs it (int4_us: the GEMV
up to w4a16.GEMV_M rows, the tl.dot tiles above), the tiles forced (int4_tiles_us) and the GEMV
(int4_gemv_us, and without split-K) at M <= 4, the swapped tensor-core kernel (int4_swap_us) at M <= 16, W8A16, and torch's own int4 kernel
(_weight_int4pack_mm, tinygemm) where it runs. Each time is the median of
7 replays of a CUDA graph of many calls, timed with device events; every call reads a different copy
of the weights (256 MB or more of each format in rotation, 5x the L2), so nothing is served from L2.
Inputs are fresh random numbers. % of roofline: the call's bytes over the copy bandwidth measured in
this process (minillm.hw.ceilings, as `minillm bench` measures it). Then a small GEMV tile sweep at M = 1. Writes $OUT/w4a16.json; prints one line a row.

    python scripts/gpu/w4sweep.py [--budget-s 120]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, ".")  # the repo root: its minillm, where no install is
from minillm.hw import ceilings
from minillm.kernels import w4a16 as W
from minillm.kernels import w4a16_gemv as V
from minillm.kernels import w4a16_swap as SW

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
G = 128
ROTATE_BYTES = 256e6


def time_us(calls, inner: int = 64, repeats: int = 7) -> float:
    """Median over `repeats` graph replays of µs per call; calls[i] reads weight copy i."""
    for c in calls:  # compile, allocate the counters, outside the capture
        c()
    torch.cuda.synchronize()
    inner = max(inner, len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            calls[i % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(times)


def copies(nbytes: float) -> int:
    return max(2, math.ceil(ROTATE_BYTES / nbytes))


def torch_int4(x, N, K, n):
    """tinygemm's packed weights (random nibbles), or None where this torch has no such kernel."""
    try:
        ws = []
        for _ in range(n):
            q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
            packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
            sz = torch.rand(K // G, N, 2, device="cuda", dtype=torch.bfloat16) * 0.01
            ws.append((packed, sz))
        torch.ops.aten._weight_int4pack_mm(x, *ws[0][:1], G, ws[0][1])
        return [lambda p=p, s=s: torch.ops.aten._weight_int4pack_mm(x, p, G, s) for p, s in ws]
    except Exception as e:  # the peer is optional: say why it is missing
        print(f"torch int4 peer unavailable: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop the tile sweep after this long")
    ap.add_argument("--ms", default="1,4,16")
    args = ap.parse_args()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    bw = ceilings(torch.device("cuda")).copy_gbps
    info = {"gpu": torch.cuda.get_device_name(), "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbps": bw, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("MINILLM_COMMIT", "?"), "group_size": G}
    print(json.dumps(info), flush=True)
    rows, sweep = [], []
    for name, (N, K) in SHAPES.items():
        b16, b4, b8 = 2 * N * K, N * K // 2 + 4 * N * K // G, N * K + 2 * N
        n16, n4, n8 = copies(b16), copies(b4), copies(b8)
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n16)]
        w4 = [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda"),
               torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.02 + 0.002,
               -torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.15) for _ in range(n4)]
        w8 = [(torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
               torch.rand(N, device="cuda", dtype=torch.bfloat16) * 0.01 + 1e-3) for _ in range(n8)]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            io = 2 * M * (K + N)
            row = {"layer": name, "N": N, "K": K, "M": M}
            row["bf16_us"] = time_us([lambda w=w: F.linear(x, w) for w in w16])
            row["int4_us"] = time_us([lambda w=w: W.w4a16_gemm(x, *w, G) for w in w4])
            row["int8_us"] = time_us([lambda w=w: W.w8a16_gemm(x, *w) for w in w8])
            if M <= SW.MAX_ROWS:  # the swapped tensor-core kernel alone (w4a16_gemm runs it at decode sizes)
                row["int4_swap_us"] = time_us([lambda w=w: SW.w4a16_swap(x, *w, G) for w in w4])
            if M <= V.MAX_ROWS:  # the two decode kernels apart, and the GEMV without split-K
                split = W.choose_tiles(M, N, K, G, x.dtype, x.device, None)[3]
                row["int4_tiles_us"] = time_us([lambda w=w: W.w4a16_gemm(x, *w, G, split_k=split) for w in w4])
                row["int4_gemv_us"] = time_us([lambda w=w: V.w4a16_gemv(x, *w, G) for w in w4])
                bn, bc, s, warps, stages = V.choose_gemv_tiles(N, K, x.device)
                row["gemv_split"] = s
                row["int4_gemv_nosplit_us"] = time_us([lambda w=w: V.w4a16_gemv(x, *w, G, tiles=(bn, bc, 1, warps, stages))
                                                       for w in w4])
            peer = torch_int4(x, N, K, n4)
            if peer:
                row["torch_int4_us"] = time_us(peer)
            for k, nbytes in (("bf16", b16), ("int4", b4), ("int8", b8)):
                row[f"{k}_pct_roofline"] = 100 * (nbytes + io) / (row[f"{k}_us"] * 1e-6) / (bw * 1e9)
            row["int4_vs_bf16"] = row["bf16_us"] / row["int4_us"]
            row["int8_vs_bf16"] = row["bf16_us"] / row["int8_us"]
            if "torch_int4_us" in row:
                row["int4_vs_torch_int4"] = row["torch_int4_us"] / row["int4_us"]
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        # a small sweep of the GEMV's tiles at M = 1 (BLOCK_N, BLOCK_C, split, warps, stages)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        bn, bc, s, warps, stages = V.choose_gemv_tiles(N, K, x.device)
        for cfg in [(bn, bc, s, warps, stages), (16, 32, s, 1, 2), (16, 32, s, 4, 2), (32, 32, s, 2, 2),
                    (8, 32, s, 1, 2), (16, 16, s, 1, 2), (16, 64, s, 2, 2), (16, 32, s, 2, 3),
                    (16, 32, max(1, s // 2), 2, 2), (16, 32, min(16, 2 * s), 2, 2), (32, 16, s, 2, 2),
                    (64, 16, s, 4, 2)]:
            if time.time() - t0 > args.budget_s:
                break
            try:
                t = time_us([lambda w=w: V.w4a16_gemv(x, *w, G, tiles=cfg) for w in w4], inner=32, repeats=5)
            except Exception as e:  # a config that does not compile is skipped, and said
                print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                continue
            sweep.append({"layer": name, "M": 1, "tiles": cfg, "us": t,
                          "pct_roofline": 100 * (b4 + 2 * (K + N)) / (t * 1e-6) / (bw * 1e9)})
            print(json.dumps(sweep[-1]), flush=True)
        del w16, w4, w8
        torch.cuda.empty_cache()
    out = {"info": info, "rows": rows, "gemv_sweep_m1": sweep}
    path = os.path.join(os.environ.get("OUT", "/tmp"), "w4a16.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
