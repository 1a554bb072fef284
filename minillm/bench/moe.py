"""Benchmark: chapter 10's kernels, fused MoE and paged MLA decode, against their baselines.

Three tables, each row a dict (notebook 10 plots them):

  moe     the routed experts of one layer for M tokens, real expert shapes (DeepSeek-V2-Lite: 64
          experts of 2048 -> 1408, top-6; Qwen3-30B-A3B: 128 of 2048 -> 768, top-8), uniform routing:
          the fused Triton kernel, the per-expert loop (the oracle, what a plain PyTorch model runs),
          and a dense GEMM pair of the same FLOPs ([M k, H] x [H, 2I], [M k, I] x [I, H]), the rate
          a perfect grouped GEMM would reach. TFLOP/s = 6 M k H I / time.
  skew    one shape and M, with a fraction of the tokens all routed to the same top-k experts: the
          kernel's tiles follow the counts, so skew changes the padding and the balance, not the work.
  mla     absorbed MLA decode over the paged latent cache (kernels/mla_decode.py), GB/s of latent
          read against the measured copy bandwidth (the metric at 16 heads: 30 FLOP per byte) and
          TFLOP/s (the metric at 128 heads: 242 FLOP per byte, at an H100's ridge), beside the naive
          path (up-project every cached latent to per-head K and V, then attention) for the V2-Lite
          heads, and beside the 16-heads-per-program kernel (`head_block=16`, the kernel before head
          blocks of 32-64) for V3's 128 heads.

`--tune` instead chooses the fused-MoE tiles per M on this GPU and writes the table the kernel
reads (bench/moe_tune.py).

On a GPU in bf16, timed as CUDA-graph replays (the loop cannot be captured: it syncs on expert
counts, so it is timed eagerly, as a model running it would be). On a CPU only the interpreter runs
the kernels; its numbers mean nothing and the shapes are tiny.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton

from ..hw import ceilings, default_device, device_name, time_it
from ..kernels.fused_moe import fused_experts, fused_experts_ref
from ..kernels.mla_decode import FEW_HEADS_FILL_WAVES, choose_num_splits, mla_decode, program_slots
from ..notebook import header_line
from .moe_tune import tune as tune_moe
from .table import print_table

# name: (experts, top_k, hidden, expert intermediate)
MOE_SHAPES = {"DeepSeek-V2-Lite": (64, 6, 2048, 1408), "Qwen3-30B-A3B": (128, 8, 2048, 768)}
MLA_HEADS = {"DeepSeek-V2-Lite": 16, "DeepSeek-V3": 128}  # both: kv_lora_rank 512 + rope 64
L, R, P, V = 512, 64, 128, 128


def _grids(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return dict(moe_shapes={"tiny": (8, 2, 64, 32)}, ms=[1, 16], skew_m=16, skews=[0.0, 1.0],
                    mla_heads={"tiny": 16}, mla_batch=[2], mla_ctx=[64], lat=(32, 16))
    if quick:
        return dict(moe_shapes=MOE_SHAPES, ms=[1, 16, 256, 1024, 4096, 8192], skew_m=4096, skews=[0.0, 0.9],
                    mla_heads=MLA_HEADS, mla_batch=[32, 128], mla_ctx=[4096], lat=(L, R))
    return dict(moe_shapes=MOE_SHAPES, ms=[1, 4, 16, 64, 256, 1024, 4096, 8192], skew_m=4096,
                skews=[0.0, 0.5, 0.9, 1.0], mla_heads=MLA_HEADS, mla_batch=[32, 64, 128], mla_ctx=[4096, 8192],
                lat=(L, R))


def _reps(device) -> dict:
    return dict(cuda_graph=True) if device.type == "cuda" else dict(warmup=0, reps=1, inner=1)


def _routing(M: int, E: int, top_k: int, skew: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform top-k, except that a `skew` fraction of the tokens all go to experts 0..top_k-1."""
    ids = torch.rand(M, E, device=device).argsort(dim=-1)[:, :top_k]
    hot = torch.rand(M, device=device) < skew
    ids[hot] = torch.arange(top_k, device=device)
    weights = torch.rand(M, top_k, device=device)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _experts(E, H, I, device, dtype):
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H**-0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype) * I**-0.5
    return w13, w2


def _moe_row(model, shape, M, device, dtype, ceil, skew: float = 0.0, loop: bool = True) -> dict:
    E, top_k, H, I = shape
    w13, w2 = _experts(E, H, I, device, dtype)
    x = torch.randn(M, H, device=device, dtype=dtype)
    weights, ids = _routing(M, E, top_k, skew, device)
    flops = 6.0 * M * top_k * H * I
    fused = time_it(lambda: fused_experts(x, w13, w2, weights, ids), device=device, **_reps(device))
    row = {"model": model, "M": M, "skew": skew, "fused_ms": fused * 1e3, "fused_tflops": flops / fused / 1e12,
           "pct_of_matmul": 100 * flops / fused / 1e12 / ceil.matmul_tflops}
    if not loop:
        return row
    looped = time_it(lambda: fused_experts_ref(x, w13, w2, weights, ids), device=device,
                     **({} if device.type == "cuda" else _reps(device)))
    a, b1, b2 = torch.randn(M * top_k, H, device=device, dtype=dtype), w13[0], w2[0]
    dense = time_it(lambda: F.linear(F.linear(a, b1)[:, :I], b2), device=device, **_reps(device))
    experts_hit = int(torch.unique(ids).numel())  # weight bytes a decode step must read
    weight_bytes = experts_hit * 3 * H * I * torch.empty((), dtype=dtype).element_size()
    return row | {"loop_ms": looped * 1e3, "dense_ms": dense * 1e3, "loop_tflops": flops / looped / 1e12,
                  "dense_tflops": flops / dense / 1e12, "speedup_vs_loop": looped / fused,
                  "pct_of_dense": 100 * dense / fused, "weight_gbps": weight_bytes / fused / 1e9}


def _mla_inputs(B, ctx, H, lat, device, dtype, block_size=64):
    Lr, Rr = lat
    blocks = B * ctx // block_size
    cache = torch.randn(blocks, block_size, 1, Lr + Rr, device=device, dtype=dtype)
    table = torch.randperm(blocks, device=device).to(torch.int32).view(B, ctx // block_size)  # scattered blocks
    q = torch.randn(B, H, Lr + Rr, device=device, dtype=dtype)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, cache, lens, torch.arange(B, dtype=torch.int32, device=device), table


def _mla_row(model, H, B, ctx, lat, device, dtype, ceil) -> dict:
    Lr, Rr = lat
    q, cache, lens, seq_idx, table = _mla_inputs(B, ctx, H, lat, device, dtype)
    ours = time_it(lambda: mla_decode(q, cache, lens, seq_idx, table, Lr, 0.1), device=device, **_reps(device))
    elt = torch.empty((), dtype=dtype).element_size()
    nbytes = (B * ctx * (Lr + Rr) + B * H * (2 * Lr + Rr)) * elt  # latents, q read, out written
    flops = 2.0 * B * H * ctx * ((Lr + Rr) + Lr)  # q.k over L + R, then p.v over L
    row = {"model": model, "heads": H, "batch": B, "context": ctx, "mla_us": ours * 1e6,
           "mla_gbps": nbytes / ours / 1e9, "pct_of_copy": 100 * nbytes / ours / 1e9 / ceil.copy_gbps,
           "mla_tflops": flops / ours / 1e12, "pct_of_matmul": 100 * flops / ours / 1e12 / ceil.matmul_tflops}
    # the other split rule (mla_decode.choose_num_splits), timed in the same process: an ablation
    sms, hb = program_slots(device, H > 16), triton.cdiv(H, 64 if H > 16 else 16)
    auto = choose_num_splits(B, hb, table.shape[1] * 64, sms, fill_waves=H > 16 or FEW_HEADS_FILL_WAVES)
    alt = choose_num_splits(B, hb, table.shape[1] * 64, sms, fill_waves=not (H > 16 or FEW_HEADS_FILL_WAVES))
    row |= {"splits": auto, "alt_splits": alt}
    if alt != auto:
        t_alt = time_it(lambda: mla_decode(q, cache, lens, seq_idx, table, Lr, 0.1, num_splits=alt), device=device,
                        **_reps(device))
        row |= {"alt_us": t_alt * 1e6, "speedup_vs_alt": t_alt / ours}
    if H > 16:  # the same kernel with 16 heads per program (what ran before head blocks of 32-64)
        old = time_it(lambda: mla_decode(q, cache, lens, seq_idx, table, Lr, 0.1, head_block=16), device=device,
                      **_reps(device))
        row |= {"bh16_us": old * 1e6, "bh16_tflops": flops / old / 1e12, "speedup_vs_bh16": old / ours}
    if H <= 16:  # naive: every cached latent up-projected to K/V of every head, then attention
        w_kv = torch.randn(H * (P + V), Lr, device=device, dtype=dtype) * Lr**-0.5
        q_naive = torch.randn(B, H, 1, P + Rr, device=device, dtype=dtype)

        def naive():
            c = cache.view(-1, Lr + Rr)[table.view(-1).long().repeat_interleave(64) * 64
                                        + torch.arange(64, device=device).repeat(table.numel())]
            kv = F.linear(c[:, :Lr], w_kv).view(B, ctx, H, P + V)
            k = torch.cat((kv[..., :P], c[:, Lr:].view(B, ctx, 1, Rr).expand(B, ctx, H, Rr)), -1).transpose(1, 2)
            return F.scaled_dot_product_attention(q_naive, k, kv[..., P:].transpose(1, 2))

        naive_s = time_it(naive, device=device, **_reps(device))
        row |= {"naive_us": naive_s * 1e6, "speedup_vs_naive": naive_s / ours}
    return row


def run(device=None, quick: bool = False, json: str | None = None, tune: bool = False, tune_budget: float = 240.0,
        tune_copy_to: str | None = None) -> dict:
    device = default_device() if device is None else torch.device(device)
    gpu = device.type == "cuda"
    if tune:
        if not gpu:
            raise ValueError("--tune times kernels: it needs a CUDA device")
        print(header_line())
        return {"tune": tune_moe(MOE_SHAPES, budget_s=tune_budget, copy_to=tune_copy_to)}
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("on a CPU the Triton kernels run only in Triton's interpreter: "
                         "run TRITON_INTERPRET=1 minillm bench moe")
    dtype = torch.bfloat16 if gpu else torch.float32
    grid = _grids(gpu, quick)
    ceil = ceilings(device)
    line = header_line()  # device, versions, date: stored with the numbers
    print(line)
    print_table([ceil.as_dict()], title="measured ceilings")
    where = device_name(device) + ("" if gpu else ", Triton interpreter: these times measure the interpreter")
    torch.manual_seed(0)
    moe = [_moe_row(name, shape, M, device, dtype, ceil) for name, shape in grid["moe_shapes"].items()
           for M in grid["ms"]]
    first = next(iter(grid["moe_shapes"].items()))
    skew = [_moe_row(first[0], first[1], grid["skew_m"], device, dtype, ceil, s, loop=False) for s in grid["skews"]]
    mla = [_mla_row(name, H, B, ctx, grid["lat"], device, dtype, ceil) for name, H in grid["mla_heads"].items()
           for B in grid["mla_batch"] for ctx in grid["mla_ctx"]]
    print_table(moe, title=f"fused MoE vs per-expert loop vs dense GEMMs of the same FLOPs, {where}")
    print_table(skew, title=f"routing skew (fraction of tokens on the same top-k experts), {where}")
    print_table(mla, title=f"paged MLA decode (absorbed): GB/s vs copy, TFLOP/s vs matmul, vs the naive path and "
                           f"vs 16 heads per program, {where}")
    result = {"header": line, "device": where, "dtype": str(dtype).removeprefix("torch."), "interpreted": not gpu,
              "ceilings": ceil.as_dict(), "moe": moe, "skew": skew, "mla": mla}
    if json:
        import json as _json

        with open(json, "w") as f:
            _json.dump(result, f, indent=1)
    return result


def add_arguments(p, name: str) -> None:
    p.add_argument("--device", default=None, help="cuda, cpu (interpreter) ...; default: cuda if there is one")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--json", default=None, help="write the tables to this file")
    p.add_argument("--tune", action="store_true",
                   help="tune the fused-MoE tiles per M on this GPU and write kernels/moe_configs/*.json")
    p.add_argument("--tune-budget", type=float, default=240.0, help="seconds of tuning before it stops (default 240)")
    p.add_argument("--tune-copy-to", default=None, help="also write the tuned tables into this folder")
