# ruff: noqa: B023  (benchmark closures are timed at once, inside their loop)
"""Tile sweep of the W4A16/W8A16 decode kernel at M = 1 and 16 on Llama-3-8B shapes vs cuBLAS bf16."""
import itertools
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from minillm.kernels import w4a16 as W
from minillm.layers.quantization.utils import quantize_int4, quantize_int8

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
shapes = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
res = []
t_start = time.time()
for name, (N, K) in shapes.items():
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    qw, s, m = quantize_int4(w, 128)
    q8, s8 = quantize_int8(w)
    for M in (1, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        t_bf16 = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=20)
        t_now4 = do_bench_cudagraph(lambda: W.w4a16_gemm(x, qw, s, m, 128), rep=20)
        t_now8 = do_bench_cudagraph(lambda: W.w8a16_gemm(x, q8, s8), rep=20)
        best = {}
        for bits, bn, bk, split, warps, stages in itertools.product((4, 8), (32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16),
                                                                    (4,), (3, 5)):
            if bits == 4 and bk > 128:
                continue
            if os.environ.get('NOSWEEP') or time.time() - t_start > 430:
                break
            y = torch.empty((M, N), dtype=x.dtype, device="cuda")
            out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device="cuda")
            k_tiles = triton.cdiv(K, bk)
            kps = triton.cdiv(k_tiles, split) * bk
            qq, ss, mm = (qw, s, m) if bits == 4 else (q8, s8, s8)
            grid = (1, triton.cdiv(N, bn), split)
            def f():
                W._wna16_kernel[grid](x, qq, ss, mm, out, M, N, K, 128, kps, x.stride(0), qq.stride(0), ss.stride(0), N, M * N,
                                      WEIGHT_BITS=bits, GROUPED_8=False, IEEE=False, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                      num_warps=warps, num_stages=stages)
                if split > 1:
                    y.copy_(out.sum(0))
            try:
                t = do_bench_cudagraph(f, rep=10)
            except Exception:
                continue
            cfg = dict(bn=bn, bk=bk, split=split, warps=warps, stages=stages)
            if bits not in best or t < best[bits][0]:
                best[bits] = (t, cfg)
        row = {"layer": name, "N": N, "K": K, "M": M, "bf16_us": t_bf16 * 1e3, "w4_now_us": t_now4 * 1e3,
               "w8_now_us": t_now8 * 1e3, **{f"w{b}_best_us": v[0] * 1e3 for b, v in best.items()},
               **{f"w{b}_best_cfg": v[1] for b, v in best.items()}}
        row["w4_best_x"] = t_bf16 / best[4][0] if 4 in best else None
        row["w4_now_x"], row["w8_now_x"] = t_bf16 / t_now4, t_bf16 / t_now8
        res.append(row)
        print(json.dumps(row), flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/w4sweep.json", "w"), indent=1)
