"""Helpers for the LoRA tests: PEFT adapters with random weights, and PEFT's greedy tokens (the oracle)."""

from __future__ import annotations

import torch
from tiny_models import hf_model


def make_adapter(base, folder, seed: int, **fields):
    """A PEFT adapter with random weights, saved in PEFT's format; -> the PEFT model (the oracle)."""
    import peft

    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(**fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "lora_" in name:
                w.copy_(torch.randn(w.shape, generator=g) * 0.15)
    model.save_pretrained(folder)
    return model.eval()


def peft_greedy(model, ids: list[int], n: int = 8) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()
