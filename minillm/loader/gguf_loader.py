"""Loading a Llama model from a GGUF file (the embedded SmolLM2 by default).

GGUF names tensors llama.cpp's way (`blk.3.attn_q.weight`); we rename them to Hugging Face's
(`model.layers.3.self_attn.q_proj.weight`) and hand them to the model's `load_weights`, so one code
path fills the model whatever the file.

One more difference: llama.cpp's RoPE rotates adjacent pairs (0,1), (2,3), ... while Hugging Face's
rotates (i, i + head_dim/2). Its converter reorders the rows of q and k within each head to make up
for that; we undo the reordering so the model can use the Hugging Face layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..gguf_meta import open_gguf, read_gguf_metadata
from .dequant import dequantize, repack

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return f"{_TOP[parts[0]]}.{parts[1]}"


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order for q/k.

    Its converter viewed each head's rows as [2, D/2] (first half, second half) and transposed to
    [D/2, 2], interleaving the halves; we view them as [D/2, 2] and transpose back.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_config(path: str | Path, name: str = "") -> ModelConfig:
    """The header's config, checked against the file's tensor shapes (before anything is allocated);
    an error names the file, the metadata key and its value."""
    try:
        config = ModelConfig.from_gguf(read_gguf_metadata(path), name=name)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    tensors = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in open_gguf(path).tensors}
    emb = tensors.get("token_embd.weight")
    if emb is not None and emb != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{path}: vocab_size={config.vocab_size} and llama.embedding_length={config.hidden_size} "
                         f"say token_embd.weight is {[config.vocab_size, config.hidden_size]}, but it is {list(emb)}")
    blocks = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.")}
    if blocks and max(blocks) + 1 != config.num_layers:  # fewer: a raw "has no place" from the model later
        raise ValueError(f"{path}: llama.block_count={config.num_layers}, but the file holds blocks 0 to "
                         f"{max(blocks)}")
    return config.with_(tie_word_embeddings="output.weight" not in tensors)


def tensor_types(path: str | Path) -> dict[str, str]:
    """The file's tensors in HF naming -> their GGUF type ("Q4_1", "Q8_0", "F32", ...)."""
    return {hf_name(t.name): t.tensor_type.name for t in open_gguf(path).tensors}


def iter_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quant_config=None, stacked_params_mapping=()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on `device`) for every tensor of the file: dequantized to `dtype`, or, where a
    bound GGUFConfig keeps a layer packed, its repacked tensors ("...q_proj.qweight", ".scales", ...)."""
    mapping = list(stacked_params_mapping)
    for t in open_gguf(path).tensors:
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the fastest dimension first
        try:
            data = np.asarray(t.data)
        except Exception as e:
            raise ValueError(f"GGUF tensor {t.name} cannot be read (truncated file?): {e}") from e
        name = hf_name(t.name)
        raw = torch.from_numpy(data.copy()).to(device)
        if quant_config is not None and quant_config.packs(name, mapping):
            tensors = {name[: -len("weight")] + k: v for k, v in repack(raw, kind, shape).items()}
        elif kind in ("F32", "F16", "BF16"):
            tensors = {name: (raw.view(torch.bfloat16) if kind == "BF16" else raw).reshape(shape).to(dtype)}
        else:
            tensors = {name: dequantize(raw, kind, shape).to(dtype)}
        for key, w in tensors.items():
            # q and k rows come in llama.cpp's order: packed tensors are row-major too, so the same fix
            if ".q_proj." in key:
                w = unpermute(w, config.num_heads)
            elif ".k_proj." in key:
                w = unpermute(w, config.num_kv_heads)
            yield key, w
