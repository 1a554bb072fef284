"""What the serving benchmarks share: the model (minillm's and HF's), the requests, the statistics.

    --model (default)          the embedded SmolLM2-135M, from its GGUF file, for both
    --model qwen3-0.6b-dummy   a preset's real shapes (minillm/config.py PRESETS) with random weights
    --model PATH               a .gguf file or an HF folder, loaded by both
    model=ModelConfig(...)     (Python) any shape, random weights: what the tests use
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cache import bytes_per_token, kv_cache_spec
from ..checks import check_int
from ..config import PRESETS, ModelConfig, preset
from ..layers.moe import SparseMoeBlock

DUMMY = "-dummy"


class NoTextTokenizer:
    """Dummy weights come without a tokenizer, but the engine detokenizes every token it makes (for
    stop strings and streaming): this one turns every id into no text, so that work costs nothing."""

    eos_token_id = None

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        return b""


@dataclass
class ServingModels:
    label: str  # how the table names the model
    model: torch.nn.Module  # minillm's
    config: ModelConfig
    tokenizer: object
    hf_source: object  # what load_hf builds the peer from: a ModelConfig or a path
    dtype: torch.dtype
    device: torch.device

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def weight_bytes(self) -> int:
        """Bytes a batch-1 decode step must read of the weights: every parameter once (a tied embedding
        counts once, as the LM head reads it), except an untied input embedding, of which it reads one
        row, and the routed experts of a mixture of experts, of which one token runs top_k of E."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())  # tied: listed once
        if not self.config.tie_word_embeddings:
            emb = self.model.model.embed_tokens.weight  # [vocab, hidden]
            total -= (emb.shape[0] - 1) * emb.shape[1] * emb.element_size()
        for block in self.model.modules():
            if isinstance(block, SparseMoeBlock):  # w13 [E, 2I, H], w2 [E, H, I]: read top_k experts' slices
                E, k = block.moe.num_experts, block.moe.num_experts_per_tok
                for w in (block.experts.w13.weight, block.experts.w2.weight):
                    total -= (E - k) * w[0].numel() * w.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token, as the model's layers state them (cache/spec.py)."""
        return bytes_per_token(kv_cache_spec(self.model))


def load_models(model, device: torch.device, dtype: torch.dtype | None = None, quantization=None) -> ServingModels:
    """quantization: what LLM(quantization=...) takes (chapter 08); the label names it."""
    from ..loader import load_model
    from ..model_files import embedded_model_path, resolve_source

    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)  # as LLM(dtype="auto")
    if isinstance(model, str) and model.endswith(DUMMY) and not Path(model).exists():
        name = model.removesuffix(DUMMY)
        if name not in PRESETS:
            raise ValueError(f"model {model!r}: no preset {name!r}; dummy models: "
                             f"{', '.join(p + DUMMY for p in PRESETS)}")
        model = preset(name)
    if isinstance(model, ModelConfig):
        m, cfg, _ = load_model(model, dtype=dtype, device=device, load_format="dummy", quantization=quantization)
        label = f"{cfg.name or cfg.architecture} (dummy weights{_quant_label(quantization)})"
        return ServingModels(label, m, cfg, NoTextTokenizer(), cfg, dtype, device)
    if model is not None and not isinstance(model, (str, Path)):
        raise TypeError(f"model must be None, a preset name + '{DUMMY}', a path or a ModelConfig, not {model!r}")
    path = embedded_model_path() if model is None else resolve_source(model)
    m, cfg, tok = load_model(path, dtype=dtype, device=device, quantization=quantization)
    if path.is_dir() and not (path / "config.json").is_file():  # a folder holding a GGUF file
        path = sorted(path.glob("*.gguf"))[0]
    label = (cfg.name or path.name) + (f" ({_quant_label(quantization)[2:]})" if quantization is not None else "")
    return ServingModels(label, m, cfg, tok, path, dtype, device)


def _quant_label(quantization) -> str:
    if quantization is None:
        return ""
    if isinstance(quantization, dict):  # {"method": "awq", "group_size": 64} -> "awq group_size=64"
        options = " ".join(f"{k}={v}" for k, v in quantization.items() if k != "method")
        return f", {quantization.get('method')}" + (f" {options}" if options else "")
    return f", {quantization if isinstance(quantization, str) else getattr(quantization, 'name', quantization)}"


def random_requests(rng: random.Random, num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, all from one seeded generator: per request, its prompt
    length, its output length, then its prompt's ids, uniform over the whole vocabulary."""
    out = []
    for _ in range(num):
        p, o = rng.randint(*input_len), rng.randint(*output_len)
        out.append(([rng.randrange(vocab_size) for _ in range(p)], o))
    return out


def percentiles(values, prefix: str, scale: float = 1e3) -> dict:
    """{prefix_p50_ms, prefix_p99_ms} (scale 1e3: seconds to ms); NaN when there are no values."""
    if len(values) == 0:
        return {f"{prefix}_p50_ms": float("nan"), f"{prefix}_p99_ms": float("nan")}
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99]) * scale
    return {f"{prefix}_p50_ms": float(p50), f"{prefix}_p99_ms": float(p99)}


def check_range(name: str, lo, hi) -> None:
    check_int(f"min_{name}", lo)
    check_int(f"max_{name}", hi)
    if lo > hi:
        raise ValueError(f"min_{name} ({lo}) must be <= max_{name} ({hi})")


def header(title: str) -> dict:
    """Print and return where the numbers come from: device, versions, date, measured ceilings."""
    import transformers

    from ..hw import ceilings
    from ..notebook import header_line
    from .table import print_table

    line = f"{header_line()} | transformers {transformers.__version__}"
    print(line)
    ceil = ceilings()
    print_table([ceil.as_dict()], title="measured ceilings")
    print()
    print(title)
    return {"header": line, "ceilings": ceil.as_dict(), "copy_gbps": ceil.copy_gbps}


def free_engine(engine) -> None:
    """Give the engine's KV pool and CUDA graphs back before the peer runs in the same process: the
    pool took gpu_memory_utilization of the GPU, and HF needs room for its own cache."""
    import gc

    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
