# ruff: noqa: B023  (benchmark closures are timed at once, inside their loop)
"""Issue 25's GGUF miss: the embedded SmolLM2's int4 GEMMs (K = 576 or 1,536, groups of 32) at M = 1 and 4,
the swap kernel with every (BLOCK_N, split_k, stages) against bf16 cuBLAS and the GEMV kernel, CUDA-graph
timing. The question: is split-K (9 slices of 64 weights at K = 576 under choose_swap_tiles) what makes
these latency-bound kernels slower than bf16?
    python3 scripts/gpu/w4_small_k.py OUT_DIR        -> OUT_DIR/w4_small_k.json and a table
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from minillm.kernels.w4a16 import pack_int4, w4a16_gemm_ref
from minillm.kernels.w4a16_gemv import w4a16_gemv
from minillm.kernels.w4a16_swap import choose_swap_tiles, w4a16_swap

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
dev = torch.device("cuda")
G = 32
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "llama_qkv": (6144, 4096), "llama_down": (4096, 14336)}  # the last two: the rule must not hurt them
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
print(res["gpu"], flush=True)


def us(fn) -> float:
    return do_bench_cudagraph(fn, rep=25) * 1e3


for name, (N, K) in SHAPES.items():
    q = torch.randint(0, 16, (N, K), device=dev)
    qw = pack_int4(q)
    scales = torch.rand(N, K // G, device=dev, dtype=torch.bfloat16) * 0.02
    mins = -8 * scales
    w = (q.float().view(N, K // G, G) * scales.float()[..., None] + mins.float()[..., None]).view(N, K).bfloat16()
    for M in (1, 4):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = w4a16_gemm_ref(x, qw, scales, mins, G).float()
        row = {"layer": name, "N": N, "K": K, "M": M, "bf16_us": us(lambda: F.linear(x, w)),
               "gemv_us": us(lambda: w4a16_gemv(x, qw, scales, mins, G)), "chosen": choose_swap_tiles(N, K, G, dev)}
        row["chosen_us"] = us(lambda: w4a16_swap(x, qw, scales, mins, G))
        sweep = {}
        for bn in (16, 32, 64, 128):
            for split in sorted({1, 2, 3, 4, 6, 9, 12, 16} & set(range(1, K // G + 1))):
                for stages in (2, 4):
                    tiles = (bn, split, 4, stages)
                    try:
                        y = w4a16_swap(x, qw, scales, mins, G, tiles=tiles)
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        sweep[f"{bn},{split},4,{stages}"] = (us(lambda: w4a16_swap(x, qw, scales, mins, G, tiles=tiles)),
                                                              err)
                    except Exception as e:  # a tile that does not compile is a result, not a crash
                        sweep[f"{bn},{split},4,{stages}"] = (None, f"{type(e).__name__}")
        ok = {k: v for k, v in sweep.items() if v[0] is not None and v[1] < 1e-2}
        best = min(ok, key=lambda k: ok[k][0])
        best_no_split = min((k for k in ok if k.split(",")[1] == "1"), key=lambda k: ok[k][0])
        row |= {"best": best, "best_us": ok[best][0], "best_split1": best_no_split, "best_split1_us": ok[best_no_split][0],
                "sweep": sweep}
        res["rows"].append(row)
        print(f"{name:10s} N={N:5d} K={K:5d} M={M}  bf16 {row['bf16_us']:6.2f}  gemv {row['gemv_us']:6.2f}  "
              f"chosen {row['chosen']} {row['chosen_us']:6.2f}  best {best} {ok[best][0]:6.2f}  "
              f"best split 1 {best_no_split} {ok[best_no_split][0]:6.2f} us", flush=True)
with open(f"{OUT}/w4_small_k.json", "w") as f:
    json.dump(res, f, indent=1)
