"""Chapter 13's fused decode layer on a GPU: kernels per graphed decode layer, each fused kernel timed
against the unfused kernels it replaces, and a whole graphed batch-1 decode step with the fusions on
and off. Writes $OUT/fused_decode.json (and prints a table).

    python scripts/gpu/fused_decode.py

Timing: each op is captured 20 times back to back in one CUDA graph (as a graphed decode step runs
it: launch cost included, no Python); one replay timed with CUDA events; the median of 25 replays,
divided by 20. Peers (the unfused kernels, cuBLAS) in the same process, on the same inputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import triton
from kernel_count import decode_step, gpu_kernels, per_layer, preset_model

import minillm.kernels.flash_decode as fd
import minillm.layers.attention as attention
import minillm.layers.layernorm as layernorm
from minillm.kernels.activation import silu_and_mul
from minillm.kernels.rms_norm import fused_add_rms_norm, rms_norm
from minillm.kernels.rope_store_kv import rope_store_kv
from minillm.kernels.rotary import apply_rotary_
from minillm.kernels.skinny_gemm import skinny_gemm
from minillm.kernels.store_kv import store_kv

DEV = torch.device("cuda")
BF16 = torch.bfloat16
REPS = 20


def graphed_us(fn, replays: int = 25) -> float:
    """Median µs of one fn() call, REPS calls captured back to back in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPS)
    return statistics.median(times)


def pair(name: str, fused, unfused, **info) -> dict:
    f, u = graphed_us(fused), graphed_us(unfused)
    row = dict(name=name, fused_us=round(f, 2), unfused_us=round(u, 2), speedup=round(u / f, 3), **info)
    print(f"{name:58s} fused {f:7.2f} µs   unfused {u:7.2f} µs   x{u / f:5.2f}", flush=True)
    return row


def rnd(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def bench_rope(Hq, Hkv, D, T, qk_norm) -> dict:
    qkv = rnd(T, (Hq + 2 * Hkv) * D)
    q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in ((0, Hq * D), (Hq * D, (Hq + Hkv) * D),
                                                         ((Hq + Hkv) * D, (Hq + 2 * Hkv) * D)))
    cs = rnd(T, 2, D)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    kc, vc = rnd(4096, 16, Hkv, D), rnd(4096, 16, Hkv, D)
    slots = torch.randperm(4096 * 16, device=DEV)[:T]
    qw, kw = rnd(D) + 1, rnd(D) + 1
    norms = dict(q_norm_weight=qw, k_norm_weight=kw) if qk_norm else {}

    def unfused():
        qq, kk = q, k
        if qk_norm:
            qq = rms_norm(q.reshape(-1, D), qw, 1e-6).view(T, Hq, D)
            kk = rms_norm(k.reshape(-1, D), kw, 1e-6).view(T, Hkv, D)
        apply_rotary_(qq, kk, cos, sin)
        store_kv(kk, v, kc, vc, slots)

    return pair(f"rope+store_kv{' +qk_norm' if qk_norm else ''} Hq={Hq} Hkv={Hkv} D={D} T={T}",
                lambda: rope_store_kv(q, k, v, cos, sin, kc, vc, slots, **norms), unfused,
                kernels_fused=1, kernels_unfused=4 if qk_norm else 2)


def bench_decode(Hq, Hkv, D, seq_len, table_keys=4096) -> dict:
    nb = table_keys // 16
    kc, vc = rnd(nb + 1, 16, Hkv, D), rnd(nb + 1, 16, Hkv, D)
    table = torch.arange(1, nb + 1, device=DEV, dtype=torch.int32)[None]
    q = rnd(1, Hq, D)
    lens = torch.tensor([seq_len], device=DEV, dtype=torch.int32)
    return pair(f"flash_decode merge in-kernel vs combine Hq={Hq} Hkv={Hkv} len={seq_len}/{table_keys}",
                lambda: fd.flash_decode(q, kc, vc, lens, table),
                lambda: fd.flash_decode(q, kc, vc, lens, table, fused_combine=False),
                splits=fd.choose_num_splits(1, Hkv, table_keys, fd.sm_count(DEV)))


def bench_skinny(M, H, N, what) -> dict:
    x, res = rnd(M, H), rnd(M, H)
    w, nw = rnd(N, H, scale=H**-0.5), rnd(H) + 1
    if what == "qkv":
        fused = lambda: skinny_gemm(x, w, norm_weight=nw, residual=res)
        unfused = lambda: torch.nn.functional.linear(rms_norm(x, nw, 1e-6, res)[0], w)
        k = (1, 2)
    elif what == "gate_up":
        fused = lambda: skinny_gemm(x, w, norm_weight=nw, residual=res, silu_mul=True)
        unfused = lambda: silu_and_mul(torch.nn.functional.linear(rms_norm(x, nw, 1e-6, res)[0], w))
        k = (1, 3)
    else:  # a plain GEMM: the skinny kernel alone vs cuBLAS
        fused = lambda: skinny_gemm(x, w)
        unfused = lambda: torch.nn.functional.linear(x, w)
        k = (1, 1)
    return pair(f"skinny {what:7s} M={M} K={H} N={N}", fused, unfused, kernels_fused=k[0], kernels_unfused=k[1])


def model_of(name: str, layers: int | None = None):
    return preset_model(name, layers, BF16, DEV)


class Variant:
    """fused (everything), no_skinny (cuBLAS GEMMs, norms apart), unfused (the pre-chapter-13 kernels)."""

    def __init__(self, name):
        self.name, self.saved = name, []

    def __enter__(self):
        self.saved = [(layernorm, "_skinny_on", layernorm._skinny_on), (attention, "fusable", attention.fusable),
                      (fd, "flash_decode", fd.flash_decode)]
        layernorm._skinny_on = self.name == "fused"  # whatever MINILLM_SKINNY_GEMM says
        if self.name == "unfused":
            attention.fusable = lambda *a: False
            split = self.saved[2][2]
            fd.flash_decode = lambda *a, **kw: split(*a, **kw, fused_combine=False)
        return self

    def __exit__(self, *exc):
        for mod, attr, val in self.saved:
            setattr(mod, attr, val)


def save(out: Path, result: dict) -> None:
    """After each part: a run cut short by its time limit keeps what it measured."""
    (out / "fused_decode.json").write_text(json.dumps(result, indent=1))


def main():
    argparse.ArgumentParser(description=__doc__).parse_args()
    out = Path(os.environ.get("OUT", "."))
    head = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=os.environ.get("MINILLM_COMMIT") or subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                    cwd=Path(__file__).parent).stdout.strip() or "?")
    print(head, flush=True)
    result = dict(header=head, kernels=[], kernels_per_layer={}, step_us={})

    # kernels per graphed decode layer (batch 1, 4096-key tables), per variant
    for name in ("smollm2-135m", "qwen3-0.6b"):
        for variant in ("fused", "no_skinny", "unfused"):
            with Variant(variant):
                counts = {n: gpu_kernels(decode_step(model_of(name, n), batch=1, context=4096)) for n in (2, 4)}
            n = per_layer(counts[2], counts[4], 2, 4)
            result["kernels_per_layer"][f"{name} {variant}"] = dict(
                per_layer=n, per_step_4_layers=sum(counts[4].values()),
                layer={k: v / 2 for k, v in (counts[4] - counts[2]).items()})  # one layer's kernels, by name
            print(f"{name:14s} {variant:10s} {n:5.2f} kernels per graphed decode layer: "
                  f"{result['kernels_per_layer'][f'{name} {variant}']['layer']}", flush=True)
            torch.cuda.empty_cache()
    save(out, result)

    # a whole graphed batch-1 decode step (full depth), per variant
    for name in ("smollm2-135m", "qwen3-0.6b"):
        model = model_of(name)
        for variant in ("fused", "no_skinny", "unfused"):
            with Variant(variant), torch.inference_mode():
                us = graphed_us(decode_step(model, batch=1, context=512, seed=1), replays=15)
            result["step_us"][f"{name} {variant}"] = round(us, 1)
            print(f"{name:14s} {variant:10s} graphed bs1 decode step (context <= 512): {us:8.1f} µs "
                  f"= {1e6 / us:7.0f} steps/s", flush=True)
        del model
        torch.cuda.empty_cache()
    save(out, result)
    # each fusion vs its unfused kernels
    rows = result["kernels"]
    rows.append(bench_rope(9, 3, 64, 1, False))
    rows.append(bench_rope(16, 8, 128, 1, True))
    for seq_len in (45, 384, 4096):
        rows.append(bench_decode(9, 3, 64, seq_len))
        rows.append(bench_decode(16, 8, 128, seq_len))
    for M in (1, 4, 8):
        for H, (nqkv, ngu, nd) in ((576, (960, 3072, 576)), (1024, (4096, 6144, 1024))):
            rows.append(bench_skinny(M, H, nqkv, "qkv"))
            rows.append(bench_skinny(M, H, ngu, "gate_up"))
            rows.append(bench_skinny(M, H, nd, "plain"))
    x, res, w = rnd(1, 576), rnd(1, 576), rnd(576) + 1
    rows.append(pair("fused_add_rms_norm (in place) vs rms_norm(residual) H=576",
                     lambda: fused_add_rms_norm(x, res, w, 1e-6), lambda: rms_norm(x, w, 1e-6, res)))

    save(out, result)


if __name__ == "__main__":
    main()
