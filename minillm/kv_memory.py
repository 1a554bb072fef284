"""How much memory the KV cache needs: the number that sizes every serving system.

Each layer keeps, for every past token, one key and one value vector per KV head:

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    total           = bytes per token x tokens in context x sequences in the batch

Grouped-query attention (GQA) shrinks it by sharing each KV head among several query heads:
Llama-3-70B has 64 query heads but 8 KV heads, so its cache is 8x smaller than with full
multi-head attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_int

GiB = 1 << 30


@dataclass(frozen=True)
class AttentionShape:
    """The part of a model config the KV cache depends on."""

    name: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    max_context: int


# From each model's config.json (SmolLM2: the embedded GGUF's header).
MODELS = {
    "SmolLM2-135M": AttentionShape("SmolLM2-135M", 30, 9, 3, 64, 8192),
    "Llama-3-8B": AttentionShape("Llama-3-8B", 32, 32, 8, 128, 8192),
    "Llama-3.1-8B": AttentionShape("Llama-3.1-8B", 32, 32, 8, 128, 131072),
    "Llama-3-70B": AttentionShape("Llama-3-70B", 80, 64, 8, 128, 8192),
    "Llama-3.1-70B": AttentionShape("Llama-3.1-70B", 80, 64, 8, 128, 131072),
    "Llama-3.1-405B": AttentionShape("Llama-3.1-405B", 126, 128, 8, 128, 131072),
}

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float = 2) -> float:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1, dtype_bytes: float = 2
) -> float:
    """Bytes of K and V for `batch` sequences of `seq_len` tokens each."""
    for name, value in [("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len), ("batch", batch)]:
        check_int(name, value, 0)
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, (int, float)) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive number, not {dtype_bytes!r}")
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) * seq_len * batch


def model_kv_bytes(model: str | AttentionShape, seq_len: int, batch: int = 1, dtype: str = "bf16") -> float:
    if isinstance(model, str) and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)} (or pass an AttentionShape)")
    shape = MODELS[model] if isinstance(model, str) else model
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, not {dtype!r}")
    return kv_cache_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, seq_len, batch, DTYPE_BYTES[dtype])


def max_batch(model: str | AttentionShape, seq_len: int, free_bytes: float, dtype: str = "bf16") -> int:
    """How many sequences of seq_len tokens fit in free_bytes of KV memory."""
    if free_bytes < 0:
        raise ValueError(f"free_bytes must be >= 0, not {free_bytes}")
    per_seq = model_kv_bytes(model, seq_len, 1, dtype)
    return int(free_bytes // per_seq) if per_seq else 0
