"""Chapter 08 part B on a GPU: the quantized KV cache and FP8 W8A8, measured. Each part writes one JSON.

    python scripts/kv_fp8_gpu.py decode    OUT   # decode attention, bf16 vs fp8 vs int8 KV: batch 32, ctx 4k
    python scripts/kv_fp8_gpu.py gemm      OUT   # FP8 W8A8 (+ activation quantization) vs bf16 cuBLAS
    python scripts/kv_fp8_gpu.py capacity  OUT   # KV pool: max concurrent tokens, bf16 vs fp8 vs int8 KV
    python scripts/kv_fp8_gpu.py agreement OUT   # embedded model, free-running greedy, bf16/fp32 KV vs fp8/int8

Sizes shrink on a CPU (Triton's interpreter) so that the script itself can be checked there; the
numbers only mean something on the GPU. Times are medians of triton.testing.do_bench (CUDA events).
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FP8, INT8 = torch.float8_e4m3fn, torch.int8


def bench_ms(fn) -> float:
    if not GPU:  # the interpreter: one timed call is all a smoke run needs
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def header() -> dict:
    return {"device": torch.cuda.get_device_name() if GPU else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# ---- decode attention over bf16 / fp8 / int8 caches ---------------------------------------------------


def decode(out: Path) -> dict:
    from minillm.kernels.flash_decode import flash_decode, flash_decode_ref
    from minillm.kernels.quant_fp8 import FP8_E4M3_MAX, INT8_MAX
    from minillm.kernels.store_kv import quantize_kv_ref

    B, ctx, Hq, Hkv, D, bs = (32, 4096, 32, 8, 128, 16) if GPU else (2, 64, 4, 2, 32, 16)  # Llama-3-8B heads
    dtype = torch.bfloat16 if GPU else torch.float16
    g = torch.Generator(device=DEVICE).manual_seed(0)
    blocks = B * ctx // bs
    k = torch.randn(blocks + 1, bs, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(blocks + 1, bs, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    table = (torch.randperm(blocks, device=DEVICE, generator=g) + 1).view(B, ctx // bs).int()  # shuffled, not 0
    q = torch.randn(B, Hq, D, device=DEVICE, dtype=dtype, generator=g)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=DEVICE)
    rows, ref = [], None
    for name, kv_dtype in (("bf16", None), ("fp8", FP8), ("int8", INT8)):
        kw = {}
        kc, vc = k, v
        if kv_dtype is not None:
            qmax = FP8_E4M3_MAX if kv_dtype == FP8 else INT8_MAX
            ks = k.float().abs().amax(dim=(0, 1, 3)) / qmax  # [Hkv]
            vs = v.float().abs().amax(dim=(0, 1, 3)) / qmax
            kc, vc = quantize_kv_ref(k, ks, kv_dtype), quantize_kv_ref(v, vs, kv_dtype)
            kw = dict(k_scale=ks, v_scale=vs)
        o = flash_decode(q, kc, vc, seq, table, **kw)
        if ref is None:
            ref = flash_decode_ref(q[:2], k, v, seq[:2], table[:2]).float()
        err = ((o[:2].float() - ref).norm() / ref.norm()).item()
        ms = bench_ms(partial(flash_decode, q, kc, vc, seq, table, **kw))
        nbytes = 2 * B * ctx * Hkv * D * kc.element_size() + 2 * q.numel() * q.element_size()
        rows.append({"kv": name, "ms": ms, "GB_s": nbytes / ms / 1e6, "bytes": nbytes, "rel_err_vs_bf16_ref": err})
        print(f"decode {name:5s} {ms:8.3f} ms  {nbytes / ms / 1e6:8.0f} GB/s  rel err vs bf16 {err:.4f}")
    for r in rows:
        r["speedup_vs_bf16"] = rows[0]["ms"] / r["ms"]
    result = {**header(), "shape": dict(batch=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, block_size=bs), "rows": rows}
    (out / "kv_decode_attention.json").write_text(json.dumps(result, indent=1))
    return result


# ---- FP8 W8A8 GEMM vs bf16 ------------------------------------------------------------------------------


def _w8a8(x, q_w, s_w, per_token: bool) -> torch.Tensor:
    from minillm.kernels.quant_fp8 import scaled_fp8_quant
    from minillm.layers.quantization.fp8 import fp8_gemm

    q_x, s_x = scaled_fp8_quant(x, per_token=per_token)
    return fp8_gemm(q_x, s_x, q_w, s_w, torch.bfloat16)


def gemm(out: Path) -> dict:
    from minillm.kernels.quant_fp8 import scaled_fp8_quant
    from minillm.layers.quantization.fp8 import fp8_gemm, quantize_weight_fp8
    from minillm.layers.quantization.utils import sqnr

    shapes = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
              "down_proj": (4096, 14336)} if GPU else {"tiny": (64, 128)}  # Llama-3-8B [N, K]
    Ms = [1, 16, 128, 2048, 4096, 8192] if GPU else [1, 16]
    rows = []
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g) / K**0.5
        for per_channel, per_token in ((True, True), (False, False)):
            q_w, s_w = quantize_weight_fp8(w, per_channel)
            for M in Ms:
                x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
                bf16_ms = bench_ms(partial(torch.mm, x, w.t())) if per_channel else None
                w8a8 = partial(_w8a8, x, q_w, s_w, per_token)  # activation quantization + GEMM, as a layer runs
                q_x, s_x = scaled_fp8_quant(x, per_token=per_token)
                fp8_ms = bench_ms(w8a8)
                gemm_ms = bench_ms(partial(fp8_gemm, q_x, s_x, q_w, s_w, torch.bfloat16))
                quant_ms = bench_ms(partial(scaled_fp8_quant, x, per_token=per_token))
                db = sqnr((x.float() @ w.float().T), w8a8().float())
                rows.append({"layer": name, "N": N, "K": K, "M": M,
                             "scales": "per-channel W, per-token x" if per_channel else "per-tensor W and x",
                             "bf16_ms": bf16_ms, "fp8_total_ms": fp8_ms, "fp8_gemm_ms": gemm_ms,
                             "act_quant_ms": quant_ms, "sqnr_db": db,
                             "fp8_tflops": 2 * M * N * K / fp8_ms / 1e9})
        for r in rows:
            if r["layer"] == name and r["bf16_ms"] is None:  # per-tensor rows: the same bf16 baseline
                r["bf16_ms"] = next(b["bf16_ms"] for b in rows if b["layer"] == name and b["M"] == r["M"]
                                    and b["bf16_ms"] is not None)
    for r in rows:
        r["speedup_vs_bf16"] = r["bf16_ms"] / r["fp8_total_ms"]
        print(f"{r['layer']:12s} M={r['M']:5d} {r['scales']:27s} bf16 {r['bf16_ms']:.4f} ms  fp8 {r['fp8_total_ms']:.4f} "
              f"ms (gemm {r['fp8_gemm_ms']:.4f} + quant {r['act_quant_ms']:.4f})  {r['speedup_vs_bf16']:.2f}x  "
              f"SQNR {r['sqnr_db']:.1f} dB")
    result = {**header(), "target": "fp8 (incl. activation quantization) >= 1.5x bf16 at M >= 2048", "rows": rows}
    (out / "fp8_gemm.json").write_text(json.dumps(result, indent=1))
    return result


# ---- KV pool capacity -------------------------------------------------------------------------------------


def capacity(out: Path) -> dict:
    from minillm.bench.serving_setup import load_models
    from minillm.engine import EngineConfig

    rows = []
    for preset in (["qwen3-0.6b", "llama-3-8b"] if GPU else ["smollm2-135m"]):
        model = load_models(f"{preset}-dummy", torch.device(DEVICE)).model  # bf16 on a GPU
        for kv in ("auto", "fp8", "int8"):
            sizes = EngineConfig(kv_cache_dtype=kv, gpu_memory_utilization=0.9).resolve(model)
            tokens = sizes.num_gpu_blocks * 16
            rows.append({"model": preset, "kv_cache_dtype": kv, "num_blocks": sizes.num_gpu_blocks,
                         "max_concurrent_tokens": tokens, "block_bytes": sizes.block_bytes})
            print(f"{preset:12s} kv={kv:5s} {sizes.num_gpu_blocks:8d} blocks = {tokens:10,d} tokens")
        del model
        if GPU:
            torch.cuda.empty_cache()
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["kv_cache_dtype"] == "auto")
        r["vs_auto"] = r["max_concurrent_tokens"] / base["max_concurrent_tokens"]
    result = {**header(), "gpu_memory_utilization": 0.9, "rows": rows}
    (out / "kv_capacity.json").write_text(json.dumps(result, indent=1))
    return result


# ---- the embedded model's greedy tokens, full-precision KV vs fp8 / int8 KV --------------------------------


def agreement(out: Path) -> dict:
    """Free-running greedy agreement (minillm.eval.kv_agreement: 8 prompts x 64 tokens, with the
    teacher-forced measures on the same texts): the bf16 model (what LLM() runs on a GPU) with its bf16
    cache vs fp8/int8, and the fp32 model with its fp32 cache vs fp8/int8 and vs a bf16 cache (the
    control); keys with per-channel scales (minillm's) and with one scale per head (for comparison)."""
    from dataclasses import asdict

    from minillm import LLM
    from minillm.eval.kv_agreement import kv_greedy_agreement

    rows = []
    for dtype in ("bfloat16", "float32") if GPU else ("float32",):
        llm = LLM(dtype=dtype, enable_kv_cache=False)
        for per_channel in (True, False):
            keys = "per channel" if per_channel else "per head"
            for r in kv_greedy_agreement(llm, max_tokens=64 if GPU else 8, per_channel_keys=per_channel):
                if r.kv_cache_dtype.startswith("bf16") and not per_channel:
                    continue  # the control has no scales: once is enough
                rows.append({"model_dtype": dtype, "key_scales": keys, **asdict(r)})
                print(f"{dtype} model, {r.kv_cache_dtype} KV, keys {keys}: {r.same_position:.1%} of {r.tokens} greedy "
                      f"tokens identical to the {dtype} cache's, {r.before_first_divergence:.1%} before each prompt's "
                      f"first difference (at {r.first_divergence}, margins "
                      f"{[m if m is None else round(m, 3) for m in r.divergence_margin]}); teacher-forced "
                      f"{r.teacher_forced_same:.1%} the same, KL {r.teacher_forced_kl:.5f}")
        del llm
    result = {**header(), "model": "embedded SmolLM2-135M-Instruct", "rows": rows}
    (out / "kv_greedy_agreement.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    parts = {"decode": decode, "gemm": gemm, "capacity": capacity, "agreement": agreement}
    if len(sys.argv) != 3 or sys.argv[1] not in parts:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(parts)}}} OUT_DIR")
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    parts[sys.argv[1]](out)
