"""Chapter 17: KV transfer bandwidth between two engine processes vs a plain copy of the same bytes.

A producer process prefills N prompts of PROMPT tokens (dummy weights, a Llama-3-8B-shaped attention:
8 KV heads of 128, bf16 on a GPU) and keeps the blocks; a consumer process loads them through the
connector (CudaIpcConnector, the default on a GPU: CUDA IPC and one-pass run copies;
SharedPoolConnector: CUDA IPC with a gather + scatter, or shared memory on a CPU;
SharedStorageConnector: files) and decodes one token each. A warm-up round first (it maps the
producer's pool and compiles the copy kernel), then REPEATS measured rounds: each round's bytes loaded /
seconds from start_load_kv to the last layer landing (on a GPU with a pool connector the side stream's
copies alone, device events; else wall time with the one-token forward pass included). The peer, in
the consumer process of the same run, right after: a plain device-to-device `copy_` of one round's bytes
(one contiguous buffer), REPEATS times, timed the same way (device events on a GPU). One JSON line on
stdout: min / median / max of both, and the ratio of the medians (the issue's target: >= 0.8).

    python3 scripts/gpu/kv_transfer_bw.py                                (a GPU)
    DEV=cpu LAYERS=2 PROMPT=64 N=2 python3 scripts/gpu/kv_transfer_bw.py   (a CPU: checks it runs)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch

DEV = os.environ.get("DEV", "cuda")
LAYERS, PROMPT, N = int(os.environ.get("LAYERS", 8)), int(os.environ.get("PROMPT", 2048)), int(os.environ.get("N", 8))
REPEATS = int(os.environ.get("REPEATS", 3))
CONNECTOR = os.environ.get("CONNECTOR", "CudaIpcConnector" if DEV == "cuda" else "SharedPoolConnector")


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"min": xs[0], "median": xs[len(xs) // 2], "max": xs[-1], "all": xs}


def plain_copy_gbps(nbytes: int) -> list[float]:
    """A device-to-device copy of nbytes (bytes copied / seconds), REPEATS times after a warm-up."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(REPEATS):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            seconds = a.elapsed_time(b) / 1e3
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        out.append(nbytes / seconds / 1e9)
    return out


def side(role: str, kv_path: str, out_path: str) -> None:
    from minillm import SamplingParams
    from minillm.config import ModelConfig
    from minillm.engine import EngineConfig, LLMEngine
    from minillm.loader import load_model
    from minillm.tokenizer import train_bpe
    from minillm.tokenizer.samples import FIXED

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    config = ModelConfig(architecture="llama", vocab_size=512, hidden_size=4096, intermediate_size=1024,
                         num_layers=LAYERS, num_heads=32, num_kv_heads=8, head_dim=128,
                         max_position_embeddings=PROMPT + 16)
    model, _, _ = load_model(config, load_format="dummy", dtype=dtype, device=DEV)
    tok = train_bpe("\n".join(FIXED), vocab_size=300)
    rounds = ["warm"] + [f"m{r}" for r in range(REPEATS)]
    blocks = len(rounds) * N * (PROMPT // 16 + 2) + 8  # every round's prompts held at once (the producer)
    kv = {"kv_connector": CONNECTOR, "kv_role": role, "kv_path": kv_path, "kv_load_timeout": 300.0,
          "kv_send_timeout": 300.0}
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=16, num_gpu_blocks=blocks, max_num_seqs=N,
                                                    max_num_batched_tokens=max(PROMPT, 16), kv_transfer_config=kv),
                       progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (PROMPT,), generator=g).tolist() for _ in range(len(rounds) * N)]
    flag = "do_remote_decode" if role == "producer" else "do_remote_prefill"
    result = {}
    for r, rnd in enumerate(rounds):
        before = engine.engine_stats.kv.as_dict()
        for i in range(N):
            p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                               extra_args={"kv_transfer_params": {flag: True, "transfer_id": f"{rnd}{i}"}})
            engine.add_request(f"{rnd}{i}", {"prompt_token_ids": prompts[i + r * N]}, p)
        done = 0
        while done < N:
            done += sum(o.finished for o in engine.step(unfinished_outputs=False))
        after = engine.engine_stats.kv.as_dict()
        result[rnd] = {k: after[k] - before[k] for k in ("kv_bytes_loaded", "kv_seconds_loading", "kv_bytes_saved",
                                                         "kv_seconds_saving")}
    if role == "consumer":  # the peer: the same bytes, one plain copy, in this process
        result["copy_gb_per_s"] = plain_copy_gbps(max(1, result["m0"]["kv_bytes_loaded"]))
    if role == "producer":
        while engine.has_unfinished_requests():  # until the consumer has taken every transfer
            engine.step()
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


def main() -> int:
    from minillm.hw import device_name

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=side, args=(r, os.path.join(tmp, "kv"), os.path.join(tmp, r + ".json")))
                 for r in ("producer", "consumer")]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join(550)
            if p.exitcode != 0:
                print(f"{p.name} failed ({p.exitcode})", file=sys.stderr)
                return 1
        got = {r: json.load(open(os.path.join(tmp, r + ".json"))) for r in ("producer", "consumer")}
    c = got["consumer"]
    rates = [c[f"m{r}"]["kv_bytes_loaded"] / c[f"m{r}"]["kv_seconds_loading"] / 1e9 for r in range(REPEATS)]
    transfer, copy = spread(rates), spread(c["copy_gb_per_s"])
    print(json.dumps({"device": device_name(torch.device(DEV)), "connector": CONNECTOR, "layers": LAYERS,
                      "prompt": PROMPT, "n": N, "repeats": REPEATS, "bytes_per_round": c["m0"]["kv_bytes_loaded"],
                      "transfer_gb_per_s": transfer, "copy_gb_per_s": copy,
                      "ratio": transfer["median"] / copy["median"], "target_ratio": 0.8,
                      "producer": got["producer"]["m0"], "wall_s": time.perf_counter() - t0,
                      "note": "two processes on one GPU share its memory bandwidth: this is not two GPUs' link"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
