"""Benchmark: chapter 04's attention kernels against PyTorch's SDPA, and what they save (chapter 04).

Four tables, each row a dict (the notebook plots them):

  prefill   causal attention over whole prompts, one sequence of S tokens and a packed batch of
            4 x S/4: TFLOP/s of minillm's FlashAttention and of SDPA's two fused Hopper-class
            backends, each forced in turn (sdpa_kernel): FlashAttention-2 (`flash`) and cuDNN
            (`cudnn`), with a ratio to each; `sdpa_ms`/`ratio` are the faster of the two. Optional
            `variants` time the kernel's ablations on the same tensors (flash_attn.VARIANTS: `v0` is
            the old kernel's settings, the before of a before/after). % of the measured bf16 matmul
            rate. Compute-bound: FLOPs count only the visible (query, key) pairs, about half the S x S
            square.
  decode    one new token per sequence over a cache of `context` keys: GB/s of K/V (plus q and out)
            actually read, against SDPA on the same K/V, and % of the measured copy bandwidth.
            Memory-bound: the kernel is as good as the bytes it streams per second.
  splits    one long-context decode shape with num_splits forced to 1, 2, 4, ...: FlashDecoding's
            effect, from too few programs to more than enough.
  materialize  plain attention (q k^T, softmax, @ v) against the flash kernel: time, and the memory
            the S x S score matrix takes.

On a GPU: SmolLM2-135M's and Llama-3-8B's attention shapes in bf16 (autotuning included, a few
minutes). On a CPU: tiny shapes in fp32 under Triton's interpreter, which only shows the code runs;
its numbers say nothing about the kernels' speed.

`minillm bench attention --only prefill --models Llama-3-8B --prefill-lengths 512,1024 --variants v0
--json out.json` picks sections, shapes and ablations, and writes every table (with the device,
versions and date) to a JSON file.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from ..hw import ceilings, default_device, device_name, time_it
from ..kernels.flash_attn import VARIANTS, chosen_tiles, flash_attn_varlen
from ..kernels.flash_decode import choose_num_splits, flash_decode, sm_count
from ..notebook import header_line
from .table import print_table

# name: (query heads, KV heads, head_dim)
GPU_SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}
CPU_SHAPES = {"tiny": (4, 2, 64)}
SECTIONS = ("prefill", "decode", "splits", "materialize")


def _grids(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return dict(shapes=CPU_SHAPES, prefill=[64], decode_batch=[1, 4], decode_ctx=[64],
                    split_shape=("tiny", 1, 128), splits=[1, 2, 4], naive=[64])
    if quick:
        return dict(shapes=GPU_SHAPES, prefill=[1024, 4096], decode_batch=[1, 16], decode_ctx=[1024, 8192],
                    split_shape=("Llama-3-8B", 2, 16384), splits=[1, 4, 16], naive=[2048])
    return dict(shapes=GPU_SHAPES, prefill=[512, 1024, 2048, 4096, 8192, 16384], decode_batch=[1, 4, 16, 64],
                decode_ctx=[512, 2048, 8192, 16384], split_shape=("Llama-3-8B", 2, 16384),
                splits=[1, 2, 4, 8, 16, 32, 64], naive=[1024, 2048, 4096, 8192])


def causal_flops(q_lens: list[int], k_lens: list[int], num_heads: int, head_dim: int) -> float:
    """FLOPs of causal attention with bottom-right aligned queries, counting visible pairs only.

    Query i of Lq sees Lk - Lq + i + 1 keys; each (query, key) pair costs a head_dim dot product for
    the score and another for the output, 2 * head_dim FLOPs each (a multiply and an add)."""
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, k_lens))
    return 4.0 * head_dim * num_heads * pairs


def _sdpa_best(q, k, v, device, backend: str = "fused", **kw) -> tuple[float, str]:
    """Fastest of SDPA with enable_gqa and SDPA on KV heads repeated beforehand (copy not timed).

    q [B, Hq, L, D]; k, v [B, Hkv, Lk, D]. On a GPU only fused backends may run: the math fallback
    would build the S x S matrix, which is the thing being compared against. backend: "fused" (any
    of FlashAttention-2, memory-efficient, cuDNN, in PyTorch's order), "flash" or "cudnn" (that one
    only). Returns (seconds, GQA form); (inf, "none") when the backend has no kernel for these inputs."""
    from contextlib import nullcontext

    backends = nullcontext
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"fused": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                  "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}[backend]
        backends = lambda: sdpa_kernel(chosen)
    group = q.shape[1] // k.shape[1]
    variants = {"gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)}
    if group > 1:
        kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        variants["repeat-kv"] = lambda: F.scaled_dot_product_attention(q, kr, vr, **kw)
    best = (float("inf"), "none")
    for name, fn in variants.items():
        try:
            with backends():
                seconds = time_it(fn, device=device, **_reps(device))
        except (RuntimeError, TypeError):  # no fused kernel for this variant on this build
            continue
        best = min(best, (seconds, name))
    return best


def _reps(device) -> dict:
    """On a GPU: replays of a CUDA graph, so both sides are timed as kernels, without the host's launch
    cost (tens of µs per call on a slow host, more than a small decode kernel takes); the engine
    removes that cost the same way in chapter 07. On a CPU: one call, the interpreter's time means
    little anyway."""
    return dict(cuda_graph=True) if device.type == "cuda" else dict(warmup=0, reps=1, inner=1)


def _paged_kv(k, v, B, L, block_size):
    """K/V [B * L, Hkv, D] copied into a paged cache [num_blocks, block_size, Hkv, D], the blocks in
    shuffled order, and the block table [B, blocks per sequence] that finds them (chapter 05's layout)."""
    per_seq = -(-L // block_size)
    order = torch.randperm(B * per_seq, device=k.device).to(torch.int32)  # physical block of each logical one
    table = order.view(B, per_seq)
    caches = []
    for t in (k, v):
        cache = torch.zeros(B * per_seq, block_size, *t.shape[1:], dtype=t.dtype, device=t.device)
        padded = torch.zeros(B, per_seq * block_size, *t.shape[1:], dtype=t.dtype, device=t.device)
        padded[:, :L] = t.view(B, L, *t.shape[1:])
        cache[order.long()] = padded.view(B * per_seq, block_size, *t.shape[1:])
        caches.append(cache)
    return caches[0], caches[1], table


def _prefill_row(model, Hq, Hkv, D, B, L, device, dtype, ceil, variants=(), block_size=None) -> dict:
    """B causal sequences of L tokens, packed into one [B * L] stream for minillm (q, k, v views of one
    fused projection, as the model makes them). block_size: K/V read from a paged cache instead, as
    the engine's prefill does (its keys were written to the cache first)."""
    qkv = torch.randn(B * L, Hq + 2 * Hkv, D, device=device, dtype=dtype)  # [T, Hq + 2 Hkv, D]
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=device)  # [B + 1]
    if block_size is None:
        k_in, v_in, kv_args = k, v, dict(cu_seqlens_k=cu)
    else:
        k_in, v_in, table = _paged_kv(k, v, B, L, block_size)
        kv_args = dict(seqused_k=torch.full((B,), L, dtype=torch.int32, device=device), block_table=table)
    flops = causal_flops([L] * B, [L] * B, Hq, D)
    mine = {}
    for name in ("tuned", *variants):
        run = lambda name=name: flash_attn_varlen(q, k_in, v_in, cu, L, **kv_args, variant=name)
        mine[name] = time_it(run, device=device, **_reps(device))
    ours = mine["tuned"]
    seqs = f"{B}x{L}" + ("" if block_size is None else f" paged{block_size}")
    row = {"model": model, "seqs": seqs, "tokens": B * L, "minillm_ms": ours * 1e3,
           "minillm_tflops": flops / ours / 1e12, "tiles": chosen_tiles("tuned")}
    # SDPA's favourite layout, [B, heads, L, D] contiguous; the conversion is not timed.
    qs, ks, vs = (t.reshape(B, L, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    backends = ("flash", "cudnn") if device.type == "cuda" else ("fused",)
    best = (float("inf"), "none")
    for backend in backends:
        seconds, form = _sdpa_best(qs, ks, vs, device, backend, is_causal=True)
        row |= {f"sdpa_{backend}_ms": seconds * 1e3, f"sdpa_{backend}_tflops": flops / seconds / 1e12,
                f"ratio_{backend}": seconds / ours}
        best = min(best, (seconds, f"{backend}/{form}"))
    row |= {"sdpa_ms": best[0] * 1e3, "sdpa_tflops": flops / best[0] / 1e12, "ratio": best[0] / ours,
            "pct_of_matmul": 100 * flops / ours / 1e12 / ceil.matmul_tflops, "sdpa_variant": best[1]}
    for name in variants:  # the ablations: how much slower the kernel is without each change
        row |= {f"{name}_ms": mine[name] * 1e3, f"speedup_vs_{name}": mine[name] / ours}
    return row


def _decode_inputs(B, ctx, Hq, Hkv, D, device, dtype):
    """A contiguous cache (chapter 03): sequence b owns block b, ctx keys long."""
    k_cache = torch.randn(B, ctx, Hkv, D, device=device, dtype=dtype)
    v_cache = torch.randn(B, ctx, Hkv, D, device=device, dtype=dtype)
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    seqused = torch.full((B,), ctx, dtype=torch.int32, device=device)
    table = torch.arange(B, dtype=torch.int32, device=device)[:, None]  # [B, 1]
    return q, k_cache, v_cache, seqused, table


def _decode_bytes(B, ctx, Hq, Hkv, D, dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return (2 * B * ctx * Hkv * D + 2 * B * Hq * D) * elt  # K and V read, q read and out written


def _decode_row(model, Hq, Hkv, D, B, ctx, device, dtype, ceil, sms) -> dict:
    q, kc, vc, seqused, table = _decode_inputs(B, ctx, Hq, Hkv, D, device, dtype)
    ours = time_it(lambda: flash_decode(q, kc, vc, seqused, table), device=device, **_reps(device))
    # SDPA on the same bytes in its own layout: q [B, Hq, 1, D], K/V [B, Hkv, ctx, D].
    k_sdpa, v_sdpa = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    theirs, variant = _sdpa_best(q[:, :, None], k_sdpa, v_sdpa, device)
    nbytes = _decode_bytes(B, ctx, Hq, Hkv, D, dtype)
    return {"model": model, "batch": B, "context": ctx, "num_splits": choose_num_splits(B, Hkv, ctx, sms),
            "minillm_us": ours * 1e6, "sdpa_us": theirs * 1e6, "minillm_gbps": nbytes / ours / 1e9,
            "sdpa_gbps": nbytes / theirs / 1e9, "ratio": theirs / ours,
            "pct_of_copy": 100 * nbytes / ours / 1e9 / ceil.copy_gbps, "sdpa_variant": variant}


def _bench_splits(device, dtype, grid, ceil, progress) -> list[dict]:
    model, B, ctx = grid["split_shape"]
    Hq, Hkv, D = grid["shapes"][model]
    q, kc, vc, seqused, table = _decode_inputs(B, ctx, Hq, Hkv, D, device, dtype)
    nbytes, rows = _decode_bytes(B, ctx, Hq, Hkv, D, dtype), []
    for s in grid["splits"]:
        seconds = time_it(lambda s=s: flash_decode(q, kc, vc, seqused, table, num_splits=s), device=device,
                          **_reps(device))
        rows.append({"model": model, "batch": B, "context": ctx, "num_splits": s, "programs": B * Hkv * s,
                     "us": seconds * 1e6, "gbps": nbytes / seconds / 1e9,
                     "pct_of_copy": 100 * nbytes / seconds / 1e9 / ceil.copy_gbps})
        progress.update()
    for r in rows:
        r["speedup_vs_1"] = rows[0]["us"] / r["us"]
    return rows


def _naive_attention(q, k, v, mask, scale):
    """What chapter 02 would do with one fused matmul per step: the whole [Hq, S, S] matrix, written out."""
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, S, S] in q's dtype
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # [B, Hq, S, D]


def _peak_extra_bytes(fn, device) -> float:
    """Memory fn allocates beyond what was allocated before it (a GPU's allocator statistics)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    extra = torch.cuda.max_memory_allocated(device) - before
    del out
    return extra


def _materialize_row(model, Hq, Hkv, D, S, device, dtype) -> dict:
    q = torch.randn(S, Hq, D, device=device, dtype=dtype)
    k = torch.randn(S, Hkv, D, device=device, dtype=dtype)
    v = torch.randn(S, Hkv, D, device=device, dtype=dtype)
    cu = torch.tensor([0, S], dtype=torch.int32, device=device)
    flash = lambda: flash_attn_varlen(q, k, v, cu, S, cu_seqlens_k=cu)
    row = {"model": model, "seq_len": S, "flash_ms": time_it(flash, device=device, **_reps(device)) * 1e3,
           "flash_extra_mb": _peak_extra_bytes(flash, device) / 2**20,
           "scores_mb": Hq * S * S * torch.empty((), dtype=dtype).element_size() / 2**20}
    try:
        qs = q.transpose(0, 1)[None]  # [1, Hq, S, D]
        ks, vs = (t.transpose(0, 1)[None].repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
        mask = torch.ones(S, S, dtype=torch.bool, device=device).tril()
        naive = lambda: _naive_attention(qs, ks, vs, mask, D**-0.5)
        row["naive_ms"] = time_it(naive, device=device, **_reps(device)) * 1e3
        row["naive_extra_mb"] = _peak_extra_bytes(naive, device) / 2**20
        row["flash_speedup"] = row["naive_ms"] / row["flash_ms"]
    except torch.cuda.OutOfMemoryError:  # the S x S matrices did not fit: the point of this table
        row["naive_ms"] = row["naive_extra_mb"] = row["flash_speedup"] = float("nan")
    return row


def _bench(device, dtype, grid, ceil, progress, sections, variants, paged) -> dict:
    sms = sm_count(device)
    out = {name: [] for name in SECTIONS}
    if "prefill" in sections:
        for model, (Hq, Hkv, D) in grid["shapes"].items():
            for S, B in itertools.product(grid["prefill"], (1, 4)):  # one sequence, and 4 of S / 4 tokens
                out["prefill"].append(_prefill_row(model, Hq, Hkv, D, B, S // B, device, dtype, ceil, variants))
                progress.update()
            for S in grid["prefill"] if paged else []:  # the engine's path: K/V through a block table
                out["prefill"].append(_prefill_row(model, Hq, Hkv, D, 1, S, device, dtype, ceil, (), paged))
    if "decode" in sections:
        for model, (Hq, Hkv, D) in grid["shapes"].items():
            for B, ctx in itertools.product(grid["decode_batch"], grid["decode_ctx"]):
                out["decode"].append(_decode_row(model, Hq, Hkv, D, B, ctx, device, dtype, ceil, sms))
                progress.update()
    if "splits" in sections and grid["split_shape"][0] in grid["shapes"]:
        out["splits"] = _bench_splits(device, dtype, grid, ceil, progress)
    model = "Llama-3-8B" if device.type == "cuda" else "tiny"
    if "materialize" in sections and model in grid["shapes"]:
        for S in grid["naive"]:
            out["materialize"].append(_materialize_row(model, *grid["shapes"][model], S, device, dtype))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            progress.update()
    return out


def _names(text: str | None, allowed, what: str) -> list[str] | None:
    """A comma-separated option as a list, every item checked against `allowed` (None: not given)."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{what} must be a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return items


def _lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        lengths = [int(t) for t in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(n < 4 or n % 4 for n in lengths):
        raise ValueError(f"prefill_lengths must be comma-separated multiples of 4 (4 x S/4 rows); got {text!r}")
    return lengths


def add_arguments(p, name: str) -> None:
    p.add_argument("--device", default=None, help="cuda, cpu (interpreter) ...; default: cuda if there is one")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--json", default=None, help="write the tables to this file")
    p.add_argument("--only", default=None, help=f"comma-separated sections to run, of {', '.join(SECTIONS)}")
    p.add_argument("--models", default=None, help="comma-separated model shapes (default: all of this device's)")
    p.add_argument("--prefill-lengths", default=None, help="comma-separated prefill lengths S (default: the grid's)")
    p.add_argument("--paged", type=int, default=None, metavar="BLOCK_SIZE",
                   help="also time one-sequence prefill reading K/V from a paged cache of this block size (the engine's 16)")
    p.add_argument("--variants", default=None,
                   help=f"prefill ablations timed beside the default kernel, of {', '.join(v for v in VARIANTS if v != 'tuned')}")


def run(device=None, quick: bool = False, json: str | None = None, only: str | None = None,
        models: str | None = None, prefill_lengths: str | None = None, variants: str | None = None,
        paged: int | None = None) -> dict:
    from tqdm.auto import tqdm

    sections = _names(only, SECTIONS, "only") or list(SECTIONS)
    ablations = _names(variants, [v for v in VARIANTS if v != "tuned"], "variants") or []
    lengths = _lengths(prefill_lengths)
    if paged is not None and (isinstance(paged, bool) or not isinstance(paged, int) or paged < 1):
        raise ValueError(f"paged must be a block size >= 1 (tokens per KV block), got {paged!r}")
    device = default_device() if device is None else torch.device(device)
    gpu = device.type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not gpu and not interpreted:
        raise ValueError("on a CPU the Triton kernels run only in Triton's interpreter: "
                         "run TRITON_INTERPRET=1 minillm bench attention")
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter gets bf16 tl.dot wrong
    grid = _grids(gpu, quick)
    if models is not None:
        grid["shapes"] = {m: grid["shapes"][m] for m in _names(models, list(grid["shapes"]), "models")}
    if lengths is not None:
        grid["prefill"] = lengths
    ceil = ceilings(device)
    line = header_line()  # device, versions, date: stored with the numbers
    print(line)
    print_table([ceil.as_dict()], title="measured ceilings")
    where = device_name(device) + ("" if gpu else ", Triton interpreter: these times measure the interpreter")
    dt = str(dtype).removeprefix("torch.")
    per_shape = 2 * len(grid["prefill"]) + len(grid["decode_batch"]) * len(grid["decode_ctx"])
    n_steps = len(grid["shapes"]) * per_shape + len(grid["splits"]) + len(grid["naive"])
    with tqdm(total=n_steps, desc="bench attention", disable=not gpu) as progress:
        res = _bench(device, dtype, grid, ceil, progress, sections, ablations, paged)
    prefill, decode, splits, materialize = res["prefill"], res["decode"], res["splits"], res["materialize"]
    sdpa_cols = ["sdpa_flash_ms", "sdpa_cudnn_ms", "ratio_flash", "ratio_cudnn"] if gpu else ["sdpa_ms", "ratio"]
    tables = {  # section: (columns, title)
        "prefill": (["model", "seqs", "minillm_ms", *sdpa_cols, "minillm_tflops", "sdpa_tflops", "pct_of_matmul",
                     "tiles", *(f"speedup_vs_{v}" for v in ablations)],
                    f"prefill, causal, {dt} on {where} (ratio_X = SDPA backend X's time / minillm's time; "
                    "sdpa_tflops: the faster backend; speedup_vs_V = variant V's time / minillm's time)"),
        "decode": (["model", "batch", "context", "num_splits", "minillm_us", "sdpa_us", "minillm_gbps", "sdpa_gbps",
                    "ratio", "pct_of_copy", "sdpa_variant"],
                   f"decode over a contiguous KV cache, {dt} on {where} (GB/s of K/V + q/out read or written; "
                   "ratio = SDPA time / minillm time)"),
        "splits": (None, f"FlashDecoding: num_splits sweep, {dt} on {where}"),
        "materialize": (None, f"materialising the S x S scores vs FlashAttention, {dt} on {where}"),
    }
    for section, (columns, title) in tables.items():
        if res[section]:
            print()
            print_table(res[section], columns, title=title)
    result = {"header": line, "device": where, "dtype": dt, "interpreted": not gpu, "ceilings": ceil,
              "prefill": prefill, "decode": decode, "splits": splits, "materialize": materialize}
    if json:
        import json as _json

        with open(json, "w") as f:
            _json.dump({**result, "ceilings": ceil.as_dict()}, f, indent=1)
    return result
