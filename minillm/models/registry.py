"""Which model file serves which architecture: the one table a new family is added to.

    "llama"  -> minillm/models/llama.py, LlamaForCausalLM   (also Mistral, Qwen2, Qwen3)
    "mixtral", "qwen3_moe" -> routed experts under Llama's attention (chapter 10)
    "deepseek_v2"  -> latent attention (MLA) and routed + shared experts; also DeepSeek-V3

A family is a file in this folder and a line here. The file is imported only when a model of that
family is built, so a family whose code needs something heavy costs nothing to the others; the
engine, the cache and the loader never name a family (they read the model's config, its
`kv_cache_spec()` and its `load_weights`). `register_model` adds one at run time (a test's tiny
architecture, or a user's own model class).
"""

from __future__ import annotations

import importlib

# model type (ModelConfig.architecture; HF's "model_type") -> (module in minillm.models, class name)
_MODELS: dict[str, tuple[str, str] | type] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek_v2", "DeepseekV2ForCausalLM"),  # V3: sigmoid routing with groups, same layers
}
# HF class name (config.json's "architectures") -> model type
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def register_model(model_type: str, model_cls: type | str, hf_architectures: tuple[str, ...] = ()) -> None:
    """Serve `model_type` with `model_cls` (a class, or "module:Class" under minillm.models, loaded
    lazily); `hf_architectures` are the config.json class names that mean this type."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty str, not {model_type!r}")
    if isinstance(model_cls, str):
        module, sep, name = model_cls.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"model_cls must be a class or 'module:ClassName', not {model_cls!r}")
        model_cls = (module, name)
    elif not isinstance(model_cls, type):
        raise TypeError(f"model_cls must be a class or 'module:ClassName', not {type(model_cls).__name__}")
    _MODELS[model_type] = model_cls
    for arch in hf_architectures:
        _HF_ARCHITECTURES[arch] = model_type


def model_types() -> list[str]:
    return sorted(_MODELS)


def hf_architectures() -> list[str]:
    return sorted(_HF_ARCHITECTURES)


def model_type_of(architectures: list[str] | None, model_type: str | None = None) -> str | None:
    """The model type a config.json means: its first known architecture, else its model_type."""
    for arch in architectures or []:
        if arch in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[arch]
    return model_type if model_type in _MODELS else None


def get_model_class(model_type: str) -> type:
    entry = _MODELS.get(model_type)
    if entry is None:
        raise ValueError(f"architecture {model_type!r} is not supported; supported: {model_types()}")
    if isinstance(entry, type):
        return entry
    module, name = entry
    return getattr(importlib.import_module(f"minillm.models.{module}"), name)
