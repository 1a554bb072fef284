"""Chapter 16: multi-LoRA serving. Adapters in PEFT's format (adapter.py), checked against the base
model; linear layers with max_loras adapter slots (layers.py), run by Punica's shrink/expand kernels
(kernels/lora_bgmv.py) with one slot per token; the CPU pool and GPU slots (manager.py).

    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("french", 1, "/adapters/french"))
"""

from .request import LoRARequest

__all__ = ["LoRARequest"]
