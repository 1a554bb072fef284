"""`minillm bench moe --tune`: choose the fused-MoE tiles per M on this GPU and write the table.

For each model shape (bench/moe.py's MOE_SHAPES) and each M, time the candidate tiles that suit the
rows an expert gets (M top_k / E), then the launch-group size of the fastest, and keep the winner:
one JSON per (experts, N = intermediate size, GPU, dtype) in kernels/moe_configs/, the file
`fused_moe.get_config` reads. Every winner is checked against the per-expert loop before it is
written. In the same process it times the tiles the kernel used before the table (autotuned over
four 64/128 tiles, rows per tile from `OLD_BLOCK_M`, row tiles launched first) and the untuned
fallback (`default_config`), and prints both ratios.
"""

from __future__ import annotations

import json
import os
import time

import torch

from ..hw import device_name, time_it
from ..kernels.fused_moe import (
    CONFIG_DIR,
    config_file_name,
    default_config,
    fused_experts,
    fused_experts_ref,
    load_configs,
)
from ..notebook import header_line
from .table import print_table

TUNE_MS = [1, 4096, 16, 1024, 8192, 256, 64, 4, 2048]  # the order they are tuned in
OLD_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]  # (BLOCK_N, BLOCK_K, warps, stages)


def _cfg(bm, bn, bk, g, w, s) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_SIZE_M=g, num_warps=w, num_stages=s)


def candidates(per_expert: float) -> list[dict]:
    """Tiles worth timing for this many rows per expert (never BLOCK_K = 32). The gate_up kernel keeps
    two fp32 accumulators, so BLOCK_M x BLOCK_N stays at or under 128 x 128 with 8 warps."""
    if per_expert <= 4:
        shapes = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 256, 4, 3),
                  (16, 128, 64, 4, 4)]
    elif per_expert <= 32:
        shapes = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 64, 4, 4),
                  (16, 64, 256, 4, 3)]
    elif per_expert <= 128:
        shapes = [(32, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4),
                  (32, 64, 128, 4, 3)]
    else:
        shapes = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4),
                  (128, 128, 128, 8, 2), (64, 256, 64, 8, 3)]
    return [_cfg(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in shapes]


def old_block_m(per_expert: float) -> int:
    """The rows per tile the kernel used before the table."""
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 256 else 128


def old_configs(per_expert: float) -> list[dict]:
    # GROUP_SIZE_M = 2^20: one group spans every row tile, so row tiles vary fastest (the old 2-D grid)
    return [_cfg(old_block_m(per_expert), bn, bk, 1 << 20, w, s) for bn, bk, w, s in OLD_TILES]


def _time(fn) -> float:
    try:
        return time_it(fn, device=torch.device("cuda"), cuda_graph=True, reps=10)
    except Exception as e:  # a tile that does not fit (shared memory, registers) is no candidate
        print(f"  skipped: {type(e).__name__}: {str(e)[:120]}")
        return float("inf")


def _write(table: dict, name: str, folders) -> None:
    ordered = {"_header": table["_header"], **{m: table[m] for m in sorted((k for k in table if k != "_header"),
                                                                           key=int)}}
    for folder in filter(None, folders):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(ordered, f, indent=1)


def tune(shapes: dict, ms: list[int] = TUNE_MS, budget_s: float = 240.0, out_dir: str = CONFIG_DIR,
         copy_to: str | None = None) -> list[dict]:
    """Tune every (M, shape) until the budget runs out, M in TUNE_MS's order (the sizes that matter
    most first: a missing M takes the nearest tuned one); write one JSON per shape; return the rows."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gpu = torch.cuda.get_device_name(device)
    start, rows = time.monotonic(), []
    g = torch.Generator(device=device).manual_seed(0)
    weights_of = {model: (torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * H**-0.5,
                          torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * I**-0.5)
                  for model, (E, top_k, H, I) in shapes.items()}
    tables = {model: {"_header": header_line()} for model in shapes}
    for M in ms:
        if time.monotonic() - start > budget_s:
            print(f"tuning budget ({budget_s:.0f} s) spent: stopped before M = {M}")
            break
        for model, (E, top_k, H, I) in shapes.items():
            w13, w2 = weights_of[model]
            x = torch.randn(M, H, device=device, dtype=dtype, generator=g)
            ids = torch.rand(M, E, device=device, generator=g).argsort(dim=-1)[:, :top_k].to(torch.int32)
            weights = torch.rand(M, top_k, device=device, generator=g).softmax(-1)
            per_expert = M * top_k / E

            def run(cfg, args=(x, w13, w2, weights, ids)):
                return _time(lambda: fused_experts(*args, config=cfg))

            timed = [(run(c), c) for c in candidates(per_expert)]
            timed_old = [(run(c), c) for c in old_configs(per_expert)]
            t_old = min(t for t, _ in timed_old)
            # the old tiles compete too: where they win, the table keeps them (a tuned M is never slower)
            t_best, best = min(timed + timed_old, key=lambda tc: tc[0])
            for group in (1, 4, 16):  # the launch order costs no compile: try it on the winner alone
                t = run(best | {"GROUP_SIZE_M": group})
                if t < t_best:
                    t_best, best = t, best | {"GROUP_SIZE_M": group}
            t_default = run(default_config(M, E, top_k, dtype))
            want = fused_experts_ref(x, w13, w2, weights, ids).float()
            got = fused_experts(x, w13, w2, weights, ids, config=best).float()
            err = ((got - want).norm() / want.norm()).item()
            if err > 2e-2:  # bf16 operands, fp32 accumulation: well under 1 %
                raise AssertionError(f"{model} M={M} {best}: relative error {err:.2e} vs the per-expert loop")
            tables[model][str(M)] = best | {"us": round(t_best * 1e6, 2)}
            rows.append({"model": model, "M": M, **best, "tuned_us": t_best * 1e6, "old_us": t_old * 1e6,
                         "default_us": t_default * 1e6, "speedup_vs_old": t_old / t_best,
                         "speedup_vs_default": t_default / t_best,
                         "tflops": 6.0 * M * top_k * H * I / t_best / 1e12, "rel_err": err})
            print(f"{model} M={M}: {best} {t_best * 1e6:.1f} us (old {t_old * 1e6:.1f}, default "
                  f"{t_default * 1e6:.1f}) [{time.monotonic() - start:.0f} s]")
            _write(tables[model], config_file_name(E, I, gpu, dtype), (out_dir, copy_to))  # after each M: a
            # timeout keeps what was tuned
    load_configs.cache_clear()
    print_table(rows, title=f"fused MoE tiles tuned per M: tuned vs old tiles vs the untuned fallback, "
                            f"{device_name(device)}")
    return rows
