"""Chapter 17: KV transfer bandwidth between two engine processes vs the device's copy bandwidth.

A producer process prefills N prompts of PROMPT tokens (dummy weights, a Llama-3-8B-shaped attention:
8 KV heads of 128, bf16 on a GPU) and keeps the blocks; a consumer process loads them through the
connector (SharedPoolConnector: CUDA IPC on one GPU, shared memory on a CPU; SharedStorageConnector:
files) and decodes one token each. A warm-up round first (it maps the producer's pool), then the
measured round: the consumer's bytes loaded / seconds from start_load_kv to the last layer landing
(on a GPU with SharedPoolConnector the side stream's copies alone, device events; else wall time with
the one-token forward pass included), beside measure_copy_gbps's device-to-device
copy (bytes copied per second: half of its read + write figure). One JSON line on stdout.

    python3 scripts/gpu/kv_transfer_bw.py                               (a GPU)
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
CONNECTOR = os.environ.get("CONNECTOR", "SharedPoolConnector")


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
    blocks = 2 * N * (PROMPT // 16 + 2) + 8  # both rounds' prompts held at once
    kv = {"kv_connector": CONNECTOR, "kv_role": role, "kv_path": kv_path, "kv_load_timeout": 300.0,
          "kv_send_timeout": 300.0}
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=16, num_gpu_blocks=blocks, max_num_seqs=N,
                                                    max_num_batched_tokens=max(PROMPT, 16), kv_transfer_config=kv),
                       progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (PROMPT,), generator=g).tolist() for _ in range(2 * N)]
    flag = "do_remote_decode" if role == "producer" else "do_remote_prefill"
    result = {}
    for rnd in ("warm", "measured"):
        before = engine.engine_stats.kv.as_dict()
        for i in range(N):
            p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                               extra_args={"kv_transfer_params": {flag: True, "transfer_id": f"{rnd}{i}"}})
            engine.add_request(f"{rnd}{i}", {"prompt_token_ids": prompts[i + (N if rnd == "measured" else 0)]}, p)
        done = 0
        while done < N:
            done += sum(o.finished for o in engine.step(unfinished_outputs=False))
        after = engine.engine_stats.kv.as_dict()
        result[rnd] = {k: after[k] - before[k] for k in ("kv_bytes_loaded", "kv_seconds_loading", "kv_bytes_saved",
                                                         "kv_seconds_saving")}
    if role == "producer":
        while engine.has_unfinished_requests():  # until the consumer has taken every transfer
            engine.step()
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


def main() -> int:
    from minillm.hw import device_name, measure_copy_gbps

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
    m = got["consumer"]["measured"]
    rate = m["kv_bytes_loaded"] / m["kv_seconds_loading"] / 1e9
    nbytes = max(1, m["kv_bytes_loaded"] // N)
    copy = measure_copy_gbps(torch.device(DEV), nbytes) / 2  # bytes copied per second
    print(json.dumps({"device": device_name(torch.device(DEV)), "connector": CONNECTOR, "layers": LAYERS,
                      "prompt": PROMPT, "n": N, "bytes_loaded": m["kv_bytes_loaded"],
                      "seconds_loading": m["kv_seconds_loading"], "transfer_gb_per_s": rate,
                      "copy_gb_per_s": copy, "ratio": rate / copy, "producer": got["producer"]["measured"],
                      "wall_s": time.perf_counter() - t0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
