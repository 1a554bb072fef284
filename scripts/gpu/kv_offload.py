"""Chapter 15: the KV offload tier on a GPU. Restore bandwidth, and TTFT of a long shared prefix from the
GPU prefix cache, from the CPU tier, and recomputed.

A Llama-3-8B-shaped model (dummy weights, bf16: 8 KV heads of 128, LAYERS layers, so 128 KiB of K/V per
token at 32 layers) behind an LLMEngine with the hash prefix cache and kv_offload_gb of pinned CPU memory,
and a GPU pool just big enough for the longest prompt, so one unrelated long prompt (the "flood") evicts
a prefix from the GPU entirely: every block of it goes to the CPU tier.

1. Bandwidth: the engine's own KVOffloadStore restores and saves NB blocks (one `transfer` call each,
   as a step makes it: DMA per run of slots, a scatter per layer tensor), timed host-side from a
   synchronized start to a synchronized end, beside a plain pinned host-to-device (and device-to-host)
   copy of the same bytes in one tensor, in the same run, alternating, REPEATS times.
2. TTFT for each prefix length in LENS: a request of a fresh random prefix + 16 tokens, max_tokens=1
   ("recompute": nothing cached); the same prefix + 16 other tokens ("gpu": a GPU prefix hit); the
   flood; the same prefix + those 16 tokens again ("cpu": restored from the CPU tier). The stats check
   each kind is what it says (hit tokens, restored blocks); the cpu hit's token must equal the gpu hit's
   (the same prompt: restored K/V are bit-identical). Kinds alternate within each of REPEATS rounds.
   TTFT: host time from add_request to the step that returns the token (synchronous scheduling, eager).
   A first round per length warms its kernels up and is left out.

JSON to $OUT/kv_offload.json (and stdout): min / median / max of every measurement.

    python3 scripts/gpu/kv_offload.py                                  (an H200: expected ~45 s wall, <= 90)
    DEV=cpu LAYERS=2 HIDDEN=256 FFN=512 LENS=64,128 NB=8 OFFLOAD_GB=0.1 python3 scripts/gpu/kv_offload.py
                                                                       (a CPU: checks that it runs)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch

DEV = os.environ.get("DEV", "cuda")
LAYERS = int(os.environ.get("LAYERS", 32))
LENS = [int(x) for x in os.environ.get("LENS", "1024,2048,4096").split(",")]
NB = int(os.environ.get("NB", 256))  # blocks per bandwidth transfer (256 x 2 MiB = 512 MiB at 32 layers)
REPEATS = int(os.environ.get("REPEATS", 3))
OFFLOAD_GB = float(os.environ.get("OFFLOAD_GB", 4))
HIDDEN, FFN = int(os.environ.get("HIDDEN", 4096)), int(os.environ.get("FFN", 14336))
BS, VOCAB, SUFFIX = 16, 512, 16


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bandwidth(store, num_gpu_blocks: int) -> dict:
    """GB/s of the store's restore and save of NB blocks vs plain pinned copies of the same bytes."""
    nb = min(NB, store.num_slots, num_gpu_blocks - 1)
    nbytes = nb * store.block_bytes
    pairs = [(i, 1 + i) for i in range(nb)]  # slots 0.., GPU blocks 1.. (block 0 is reserved)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    out = {k: [] for k in ("restore", "h2d", "save", "d2h")}
    for _ in range(REPEATS + 1):  # the first round warms up (allocator, first launches)
        t = {"restore": timed(lambda: store.transfer([], pairs)),
             "h2d": timed(lambda: dev.copy_(host, non_blocking=True)),
             "save": timed(lambda: store.transfer([(b, s) for s, b in pairs], [])),
             "d2h": timed(lambda: host.copy_(dev, non_blocking=True))}
        for k, v in t.items():
            out[k].append(nbytes / v / 1e9)
    res = {k: spread(v[1:]) for k, v in out.items()}
    return {"blocks": nb, "bytes": nbytes, "gb_per_s": res,
            "restore_vs_h2d": res["restore"]["median"] / res["h2d"]["median"],
            "save_vs_d2h": res["save"]["median"] / res["d2h"]["median"]}


def ttft(engine, rid: str, prompt: list[int]) -> tuple[float, list[int], dict]:
    """-> (seconds to the first token, the token, the stats' change)."""
    from minillm import SamplingParams

    before = engine.engine_stats.as_dict()
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True))
    token = None
    while token is None:
        for o in engine.step():
            if o.request_id == rid and o.outputs[0].token_ids:
                token = o.outputs[0].token_ids
    sync()
    dt = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.engine_stats.as_dict()
    keys = ("prefix_hit_tokens", "offload_hit_tokens", "offload_restored_blocks", "offload_saved_blocks")
    return dt, token, {k: after[k] - before[k] for k in keys}


def main() -> int:
    from minillm.config import ModelConfig
    from minillm.engine import EngineConfig, LLMEngine
    from minillm.hw import device_name
    from minillm.loader import load_model
    from minillm.tokenizer import train_bpe
    from minillm.tokenizer.samples import FIXED

    t_start = time.perf_counter()
    longest = max(LENS)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_layers=LAYERS, num_heads=32, num_kv_heads=8, head_dim=128,
                         max_position_embeddings=longest + 2 * SUFFIX + 2 * BS)
    model, _, _ = load_model(config, load_format="dummy", dtype=dtype, device=DEV)
    tok = train_bpe("\n".join(FIXED), vocab_size=300)
    # the longest prompt and its suffix fit, and little more: the flood takes every usable block (all but
    # block 0), so it evicts all of a prefix (its prompt and one generated token fit exactly)
    num_blocks = (longest + SUFFIX) // BS + 2
    flood_len = (num_blocks - 1) * BS - 1
    engine = LLMEngine(model, tok, [], EngineConfig(
        block_size=BS, num_gpu_blocks=num_blocks, max_num_seqs=1, max_num_batched_tokens=longest + 2 * SUFFIX,
        enable_prefix_caching="hash", kv_offload_gb=OFFLOAD_GB, enforce_eager=True, async_scheduling=False),
        progress=False)
    store = engine.executor.worker.runner.offload
    rng = random.Random(0)
    fresh = lambda n: [rng.randrange(VOCAB) for _ in range(n)]
    result = {"device": device_name(torch.device(DEV)), "torch": torch.__version__, "layers": LAYERS,
              "block_size": BS, "block_bytes": store.block_bytes, "num_gpu_blocks": num_blocks,
              "offload_slots": store.num_slots, "bandwidth": bandwidth(store, num_blocks), "ttft_s": {}}
    ttft(engine, "warm", fresh(longest + SUFFIX))  # first prefill: allocator, kernels
    for n in LENS:
        times = {"recompute": [], "gpu": [], "cpu": []}
        for r in range(REPEATS + 1):  # round 0 warms up this length's kernels and is not kept
            prefix, a, b = fresh(n), fresh(SUFFIX), fresh(SUFFIX)
            t, _, d = ttft(engine, f"re{n}.{r}", prefix + a)
            assert d["prefix_hit_tokens"] == d["offload_hit_tokens"] == 0, d
            times["recompute"].append(t)
            t, gpu_token, d = ttft(engine, f"gpu{n}.{r}", prefix + b)
            assert d["prefix_hit_tokens"] == n and d["offload_hit_tokens"] == 0, d
            times["gpu"].append(t)
            _, _, d = ttft(engine, f"flood{n}.{r}", fresh(flood_len))
            assert d["offload_saved_blocks"] >= n // BS, d  # the prefix went to the CPU
            t, cpu_token, d = ttft(engine, f"cpu{n}.{r}", prefix + b)
            assert d["prefix_hit_tokens"] == 0 and d["offload_hit_tokens"] == n, d
            assert cpu_token == gpu_token, (cpu_token, gpu_token)
            times["cpu"].append(t)
        s = {k: spread(v[1:]) for k, v in times.items()}
        s["cpu_vs_recompute"] = s["cpu"]["median"] / s["recompute"]["median"]
        s["cpu_vs_gpu"] = s["cpu"]["median"] / s["gpu"]["median"]
        result["ttft_s"][n] = s
    result["stats"] = {k: v for k, v in engine.engine_stats.as_dict().items() if k.startswith(("offload", "prefix"))}
    engine.shutdown()
    result["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_offload.json"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
