"""Model classes by architecture. Every supported family runs through LlamaForCausalLM."""

from .llama import LlamaForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
          "qwen3": LlamaForCausalLM}

__all__ = ["MODELS", "LlamaForCausalLM"]
