"""Chapter 16 (issue 44), a first look on a GPU: what multi-LoRA costs. A SmolLM2-shaped random model
(30 layers, hidden 576) with random rank-16 adapters on all seven projections, bf16, CUDA graphs:

    base model, no LoRA                          64 requests (128-token prompts, 128 tokens each), batch 1
    enable_lora, no request has an adapter       the same, with the LoRA kernels in every graph
    8 adapters, round-robin over the requests    the issue's "8 distinct rank-16 adapters in a batch of 64"

    python scripts/gpu/lora_overhead.py [OUT.json]

On a CPU the model shrinks (2 layers) so that the script itself can be checked; its numbers mean
nothing there. Times are wall clock around LLM.generate, after a warm-up (graphs captured).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from tiny_models import make_tiny

from minillm import LLM, LoRARequest, SamplingParams

GPU = torch.cuda.is_available()
LAYERS, N, OUT_LEN = (30, 64, 128) if GPU else (2, 4, 8)
SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def make_adapters(root: str, n: int, rank: int = 16) -> list[LoRARequest]:
    reqs = []
    for a in range(n):
        folder = os.path.join(root, f"a{a}")
        os.makedirs(folder, exist_ok=True)
        g, tensors = torch.Generator().manual_seed(a), {}
        for layer in range(LAYERS):
            for m, (i, o) in SHAPES.items():
                block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{m}"
                tensors[key + ".lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.01
                tensors[key + ".lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(SHAPES)}, f)
        reqs.append(LoRARequest(f"a{a}", a + 1, folder))
    return reqs


def tok_s(llm: LLM, n: int, loras, out_len: int) -> float:
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(128)]} for i in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                 lora_request=loras[:2] if isinstance(loras, list) else loras)
    if GPU:
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    if GPU:
        torch.cuda.synchronize()
    return n * out_len / (time.perf_counter() - t)


def main() -> None:
    root = tempfile.mkdtemp(prefix="lora-overhead-")
    base = make_tiny("llama2-tied", Path(root) / "base", hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=2048)
    adapters = make_adapters(root, 8)
    device = {"gpu_memory_utilization": 0.3} if GPU else {"device": "cpu"}
    rows = {}
    plain = LLM(str(base), **device)
    plain.engine.warm_up()
    rows["base_batch64"] = tok_s(plain, N, None, OUT_LEN)
    rows["base_batch1"] = tok_s(plain, 1, None, 2 * OUT_LEN)
    plain.shutdown()
    lora = LLM(str(base), enable_lora=True, max_loras=8, max_lora_rank=16, **device)
    lora.engine.warm_up()
    rows["lora_on_no_adapter_batch64"] = tok_s(lora, N, None, OUT_LEN)
    rows["lora_8_adapters_batch64"] = tok_s(lora, N, [adapters[i % 8] for i in range(N)], OUT_LEN)
    rows["lora_1_adapter_batch1"] = tok_s(lora, 1, adapters[0], 2 * OUT_LEN)
    rows["ratio_8_adapters_vs_base"] = rows["lora_8_adapters_batch64"] / rows["base_batch64"]
    rows["ratio_batch1_adapter_vs_base"] = rows["lora_1_adapter_batch1"] / rows["base_batch1"]
    rows["device"] = torch.cuda.get_device_name() if GPU else "cpu"
    for k, v in rows.items():
        print(f"{k:32s} {v:10.2f}" if isinstance(v, float) else f"{k:32s} {v}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
