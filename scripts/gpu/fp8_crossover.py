# ruff: noqa: B023  (benchmark closures are timed at once, inside their loop)
"""FP8 weight-only vs W8A8 vs bf16 cuBLAS on Llama-3-8B's linear shapes, by M (chapter 08, issue 25):
the crossover that layers/quantization/fp8.py's WEIGHT_ONLY_MAX_M (provisional, 16) should be.

Per shape and M: cuBLAS bf16 (F.linear); fp8 weight-only as fp8_w8a16_gemm runs it (wo_us: the W8A16
tiles with the e4m3 decode up to DECODE_M rows, dequantize-then-cuBLAS above); at M <= DECODE_M the
tiles with the integer decode instead of the GPU's cvt (wo_bits_us: what an A100 runs, and whether
the ten integer ops a weight cost an H100 its memory-bound speed); the tiles forced
above DECODE_M (wo_tiles_us, M <= 256: whether they beat the dequantization there); W8A8 as fp8 mode
runs it above the threshold (w8a8_us: minillm's per-token activation quantization + torch._scaled_mm,
per-channel weight scales) and its GEMM alone (w8a8_gemm_us, x quantized beforehand). Timing is
w4sweep.py's: the median of 7 replays of a CUDA graph of many calls, every call reading another
copy of the weights (256 MB or more per format in rotation), so nothing is served from L2.

At the end, per shape, the largest M of the list where weight-only is still at least as fast as W8A8,
and the threshold that holds for every shape. Writes $OUT/fp8_crossover.json; one line a row.

    python scripts/gpu/fp8_crossover.py [--ms 1,4,16,64,256,1024,4096]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, ".")  # the repo root: its minillm, where no install is
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # w4sweep's timing, not a copy of it
from w4sweep import SHAPES, copies, time_us

from minillm.kernels.quant_fp8 import scaled_fp8_quant
from minillm.kernels.w4a16 import DECODE_M
from minillm.kernels.w8a16_fp8 import fp8_w8a16_gemm, fp8_w8a16_gemm_ref
from minillm.layers.quantization.fp8 import WEIGHT_ONLY_MAX_M, fp8_gemm, quantize_weight_fp8


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    t0 = time.time()
    info = {"gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
            "torch": torch.__version__, "triton": triton.__version__, "threshold_now": WEIGHT_ONLY_MAX_M,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("MINILLM_COMMIT", "?")}
    print(json.dumps(info), flush=True)
    rows = []
    for name, (N, K) in SHAPES.items():
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies(2 * N * K))]
        w8 = [quantize_weight_fp8(w16[i % len(w16)]) for i in range(copies(N * K))]  # (fp8 [N, K], fp32 [N])
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            # the paths agree before they are timed (a fast wrong answer is no crossover)
            err = rel_err(fp8_w8a16_gemm(x, *w8[0]), fp8_w8a16_gemm_ref(x, *w8[0]))
            assert err < 1e-2, (name, M, err)
            row = {"layer": name, "N": N, "K": K, "M": M, "wo_vs_ref_err": err}
            row["bf16_us"] = time_us([lambda w=w: F.linear(x, w) for w in w16])
            row["wo_us"] = time_us([lambda w=w: fp8_w8a16_gemm(x, *w) for w in w8])
            if M <= DECODE_M:
                row["wo_bits_us"] = time_us([lambda w=w: fp8_w8a16_gemm(x, *w, cvt=False) for w in w8])
            if DECODE_M < M <= 256:
                row["wo_tiles_us"] = time_us([lambda w=w: fp8_w8a16_gemm(x, *w, split_k=1) for w in w8])
            row["w8a8_us"] = time_us([lambda w=w: fp8_gemm(*scaled_fp8_quant(x), *w, x.dtype) for w in w8])
            q_x, s_x = scaled_fp8_quant(x)
            row["w8a8_gemm_us"] = time_us([lambda w=w: fp8_gemm(q_x, s_x, *w, x.dtype) for w in w8])
            row["wo_vs_bf16"] = row["bf16_us"] / row["wo_us"]
            row["w8a8_vs_wo"] = row["wo_us"] / row["w8a8_us"]  # > 1: W8A8 wins at this M
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del w16, w8
        torch.cuda.empty_cache()
    # per shape: the largest listed M up to which weight-only never loses to W8A8
    crossover = {}
    for name in SHAPES:
        best = 0
        for r in sorted((r for r in rows if r["layer"] == name), key=lambda r: r["M"]):
            if r["wo_us"] > r["w8a8_us"]:
                break
            best = r["M"]
        crossover[name] = best
    summary = {"weight_only_max_m_per_shape": crossover, "threshold_for_all_shapes": min(crossover.values())}
    print(json.dumps(summary), flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "fp8_crossover.json")
    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows, "summary": summary}, f, indent=1)
    print(f"wrote {path} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
