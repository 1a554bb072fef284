# ruff: noqa: B023  (benchmark closures are timed at once, inside their loop)
"""Issue 25 experiment: two W4A16 decode kernels beside the current GEMV, timed on Llama-3-8B's shapes.

Not the engine's code: a one-call experiment to choose what kernels/w4a16_gemv.py becomes.
  group  a GEMV whose K loop walks whole groups: the scale and min are loaded once per row and group
         (not once per int32 as in w4a16_gemv.py), and the next group's packed words are loaded
         before the current one is summed (a hand prefetch: two tiles of loads in flight per thread).
  swap   "swap AB": y^T = W x^T as tl.dot(W tile [BLOCK_N, G/2], x^T [G/2, 16]) twice (low and high
         nibbles against x's even and odd columns). The dequantized weight is the dot's A operand,
         which Hopper's wgmma reads from registers; q in 0..15 is exact in bf16, so the tensor cores
         sum x q in fp32 and each group's scale and min are applied to the [BLOCK_N, 16] sums
         (sum_k x (q s + m) = s sum x q + m sum x). x is padded to 16 columns by the mask.
Both reduce split-K in the kernel in slice order, as w4a16_gemv.py does. Checked against the fp32
dequantized product first (every shape, M = 1 and 4), then timed as w4sweep.py times (CUDA graph of
many calls, weight copies rotated past the L2). CPU: TRITON_INTERPRET=1 python scripts/gpu/w4_variants.py --check
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "scripts/gpu")
from minillm.kernels import w4a16_gemv as V


@triton.jit
def _finish(acc, Y, P, Counters, offs_m, offs_n, m_ok, n_ok, M, N, stride_ym, pid_n, split, SPLIT_K: tl.constexpr):
    """acc [BM, BN] fp32: store it (one slice) or add the slices in order (the last one to arrive)."""
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_ok)
    else:
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(P + split * M * N + mn, acc, mask=y_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(P + s * M * N + mn, mask=y_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(Counters + pid_n, 0)


@triton.jit
def _group_kernel(X, QW, S, Mins, Y, P, Counters, M, N, groups_per_split, n_groups,
                  stride_xm, stride_qn, stride_sn, stride_ym,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    CPG: tl.constexpr = GROUP // 8  # int32 words per group and row
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CPG)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = QW + offs_n.to(tl.int64)[:, None] * stride_qn + offs_c[None, :]  # [BN, CPG]
    s_rows = offs_n.to(tl.int64) * stride_sn  # [BN]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    g_lo = split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N, CPG], dtype=tl.float32)
    nxt = tl.load(w_rows + g_lo * CPG, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
    for g in range(g_lo, g_hi):
        packed = nxt  # [BN, CPG] int32: this group's words
        nxt = tl.load(w_rows + (g + 1) * CPG, mask=n_ok[:, None] & (offs_c[None, :] * 0 + g + 1 < g_hi), other=0,
                      eviction_policy="evict_first")  # the next group's, in flight while this one is summed
        s16 = 16.0 * tl.load(S + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        bias = tl.load(Mins + s_rows + g, mask=n_ok, other=0.0).to(tl.float32) - s16  # [BN]
        xf = tl.zeros([BLOCK_M, BLOCK_N, CPG], dtype=tl.float32)
        xs = tl.zeros([BLOCK_M, CPG], dtype=tl.float32)
        for i in tl.static_range(8):
            if 19 - 4 * i >= 0:
                bits = packed << (19 - 4 * i)
            else:
                bits = packed >> (4 * i - 19)
            f = ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/16
            x = tl.load(x_rows + (g * GROUP + 8 * offs_c + i)[None, :], mask=m_ok[:, None], other=0.0,
                        eviction_policy="evict_last").to(tl.float32)  # [BM, CPG]
            xf += x[:, None, :] * f[None, :, :]
            xs += x
        acc += xf * s16[None, :, None] + xs[:, None, :] * bias[None, :, None]
    _finish(tl.sum(acc, axis=2), Y, P, Counters, offs_m, offs_n, m_ok, n_ok, M, N, stride_ym, pid_n, split, SPLIT_K)


@triton.jit
def _swap_kernel(X, QW, S, Mins, Y, P, Counters, M, N, groups_per_split, n_groups,
                 stride_xm, stride_qn, stride_sn, stride_ym,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GPT: tl.constexpr,
                 MAGIC: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2  # bytes per group and row
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, 16)  # x's rows, padded to the dot's smallest N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HALF)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = QW + offs_n.to(tl.int64)[:, None] * stride_qn + offs_j[None, :]  # [BN, HALF] bytes
    s_rows = offs_n.to(tl.int64) * stride_sn
    xt = X + offs_m.to(tl.int64)[None, :] * stride_xm + 2 * offs_j[:, None]  # [HALF, 16]: x^T's even columns
    g_lo = split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, GPT):
        for t in tl.static_range(GPT):  # GPT groups a step: their loads are independent, all in flight at once
            g = g0 + t
            g_ok = (offs_j * 0 + g) < g_hi  # [HALF]: this group exists (the last step may overhang)
            gn_ok = n_ok & ((offs_n * 0 + g) < g_hi)  # [BN]
            b = tl.load(w_rows + g * HALF, mask=gn_ok[:, None] & g_ok[None, :], other=0,
                        eviction_policy="evict_first")  # [BN, HALF] u8
            if MAGIC:  # bf16 bits 0x4300 | q = 128 + q, exact: one AND-OR a weight, no conversion
                b16 = b.to(tl.int16)
                lo = ((b16 & 0xF) | 0x4300).to(tl.bfloat16, bitcast=True)
                hi = ((b16 >> 4) | 0x4300).to(tl.bfloat16, bitcast=True)
            else:
                lo = (b & 0xF).to(X.dtype.element_ty)  # q at k = 2j, exact
                hi = (b >> 4).to(X.dtype.element_ty)  # q at k = 2j + 1
            xe = tl.load(xt + g * GROUP, mask=m_ok[None, :] & g_ok[:, None], other=0.0)  # [HALF, 16]
            xo = tl.load(xt + g * GROUP + 1, mask=m_ok[None, :] & g_ok[:, None], other=0.0)
            qx = tl.dot(hi, xo, tl.dot(lo, xe))  # [BN, 16] fp32: sum_k q x (MAGIC: (128 + q) x)
            xsum = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=0)  # [16]
            s = tl.load(S + s_rows + g, mask=gn_ok, other=0.0).to(tl.float32)
            mn = tl.load(Mins + s_rows + g, mask=gn_ok, other=0.0).to(tl.float32)
            if MAGIC:
                mn = mn - 128.0 * s
            acc += qx * s[:, None] + mn[:, None] * xsum[None, :]
    _finish(tl.trans(acc), Y, P, Counters, offs_m, offs_n, m_ok, n_ok, M, N, stride_ym, pid_n, split, SPLIT_K)


def run(kind, x, qweight, scales, mins, G, bn, split, warps, stages, gpt=1, magic=False):
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    n_groups = K // G
    gps = triton.cdiv(n_groups, split)
    split = triton.cdiv(n_groups, gps)
    n_tiles = triton.cdiv(N, bn)
    partials = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    counters = y if split == 1 else V.split_k_counters(x.device, n_tiles)
    common = (y, partials, counters, M, N, gps, n_groups, x.stride(0))
    if kind == "group":
        qw = qweight.view(torch.int32)
        _group_kernel[(n_tiles, split)](x, qw, scales, mins, *common[:7], x.stride(0), qw.stride(0), scales.stride(0),
                                        y.stride(0), GROUP=G, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn,
                                        SPLIT_K=split, num_warps=warps, num_stages=stages)
    else:
        _swap_kernel[(n_tiles, split)](x, qweight, scales, mins, *common[:7], x.stride(0), qweight.stride(0),
                                       scales.stride(0), y.stride(0), GROUP=G, BLOCK_N=bn, SPLIT_K=split, GPT=gpt,
                                       MAGIC=magic, num_warps=warps, num_stages=stages)
    return y


def check(device, dtype, shapes, Ms, G):
    worst = {}
    for (N, K) in shapes:
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
        s = (torch.rand(N, K // G, device=device) * 0.02 + 0.002).to(dtype)
        m = (-torch.rand(N, K // G, device=device) * 0.15).to(dtype)
        for M in Ms:
            x = torch.randn(M, K, device=device).to(dtype)
            ref = V.w4a16_gemv_ref(x.float(), q, s, m, G)
            cfgs = [("group", (16, 2, 2, 1)), ("swap", (16, 2, 4, 1)), ("swap", (16, 1, 4, 1, 2))]
            if dtype == torch.bfloat16:
                cfgs.append(("swap", (16, 2, 4, 1, 3, True)))
            for kind, cfg in cfgs:
                y = run(kind, x, q, s, m, G, *cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                key = f"{kind}{cfg}"
                worst[key] = max(worst.get(key, 0.0), err)
    return worst


def sweep2(budget_s):
    """Round 2: the swap kernel with fewer, longer programs (split aimed at 1-3 programs an SM), GPT groups
    a step, 4 or 8 warps, and the bf16 magic-number dequantization; M = 1 on three shapes and M = 16 on down."""
    from w4sweep import SHAPES, copies, time_us, torch_int4
    t0 = time.time()
    G = 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, M in (("down", 1), ("o", 1), ("gate_up", 1), ("down", 16), ("o", 4)):
        N, K = SHAPES[name]
        n16, n4 = copies(2 * N * K), copies(N * K // 2 + 4 * N * K // G)
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n16)]
        w4 = [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda"),
               torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.02 + 0.002,
               -torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.15) for _ in range(n4)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        row = {"layer": name, "N": N, "K": K, "M": M, "bf16_us": time_us([lambda w=w: F.linear(x, w) for w in w16])}
        peer = torch_int4(x, N, K, n4)
        if peer:
            row["torch_int4_us"] = time_us(peer)
        res = []
        for magic in (True, False):
            for bn in (64, 128):
                for gpt in (1, 2, 4):
                    for target in (1, 3):
                        for warps in (4, 8):
                            if time.time() - t0 > budget_s:
                                break
                            split = max(1, min(K // G // gpt, triton.cdiv(target * sms, triton.cdiv(N, bn))))
                            cfg = (bn, split, warps, 4, gpt, magic)
                            try:
                                t = time_us([lambda w=w: run("swap", x, *w, G, *cfg) for w in w4], inner=32, repeats=5)
                            except Exception as e:
                                print(f"{name} M={M} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                                continue
                            res.append((t, cfg))
        res.sort()
        row["best"] = [(round(t, 2), c) for t, c in res[:5]]
        row["worst"] = [(round(t, 2), c) for t, c in res[-2:]]
        if res:
            row["best_vs_bf16"] = row["bf16_us"] / res[0][0]
            if "torch_int4_us" in row:
                row["best_vs_torch_int4"] = row["torch_int4_us"] / res[0][0]
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="the CPU check alone (TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--round2", action="store_true", help="the second sweep (sweep2) alone")
    args = ap.parse_args()
    if args.round2:
        print("max relative error (bf16):", check("cuda", torch.bfloat16, [(4096, 4096)], [1, 16], 128), flush=True)
        return sweep2(args.budget_s)
    if args.check:
        print(check("cpu", torch.float32, [(48, 512), (40, 256)], [1, 3], 128))
        print(check("cpu", torch.float32, [(24, 256)], [2], 64))
        return
    from w4sweep import SHAPES, copies, time_us, torch_int4
    t0 = time.time()
    G = 128
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "commit": os.environ.get("MINILLM_COMMIT", "?")}), flush=True)
    print("max relative error vs fp32 dequantized product (bf16):",
          check("cuda", torch.bfloat16, list(SHAPES.values()), [1, 4, 16], G), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (N, K) in SHAPES.items():
        n16, n4 = copies(2 * N * K), copies(N * K // 2 + 4 * N * K // G)
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n16)]
        w4 = [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda"),
               torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.02 + 0.002,
               -torch.rand(N, K // G, device="cuda", dtype=torch.bfloat16) * 0.15) for _ in range(n4)]
        for M in (1, 4, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "N": N, "K": K, "M": M, "bf16_us": time_us([lambda w=w: F.linear(x, w) for w in w16])}
            if M <= 4:
                row["gemv_us"] = time_us([lambda w=w: V.w4a16_gemv(x, *w, G) for w in w4])
            peer = torch_int4(x, N, K, n4)
            if peer:
                row["torch_int4_us"] = time_us(peer)
            best = {}
            kinds = ("group", "swap") if M <= 4 else ("swap",)
            for kind in kinds:
                bns = (16, 32) if kind == "group" else (32, 64, 128)
                for bn in bns:
                    for target in (8,):  # programs per SM the split aims at
                        split = max(1, min(K // G, triton.cdiv(target * sms, triton.cdiv(N, bn))))
                        for warps in ((2, 4) if kind == "group" else (4,)):
                            for stages in ((1, 3) if kind == "swap" else (1,)):
                                if time.time() - t0 > args.budget_s:
                                    break
                                cfg = (bn, split, warps, stages)
                                try:
                                    t = time_us([lambda w=w: run(kind, x, *w, G, *cfg) for w in w4], inner=32, repeats=5)
                                except Exception as e:
                                    print(f"{name} M={M} {kind} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                                    continue
                                if t < best.get(kind, (1e9,))[0]:
                                    best[kind] = (t, cfg)
            for kind, (t, cfg) in best.items():
                row[f"{kind}_us"], row[f"{kind}_cfg"] = t, cfg
                row[f"{kind}_vs_bf16"] = row["bf16_us"] / t
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
