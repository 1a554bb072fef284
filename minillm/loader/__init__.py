"""Loading a model: from a GGUF file, a Hugging Face folder, a hub id, or as dummy weights.

    model, config, tokenizer = load_model(None)                     # the embedded SmolLM2 (GGUF)
    model, config, tokenizer = load_model("path/to/hf-folder")
    model, config, tokenizer = load_model("qwen3-0.6b", load_format="dummy")   # real shapes, random weights
    model, config, tokenizer = load_model(None, quantization="int8")   # linear weights quantized after loading

`quantization` takes what layers/quantization/ takes: None, "int8", "int4", "gguf" (a .gguf file's
Q4_1/Q8_0 blocks kept packed), {"method": "int4", "group_size": 64} or a QuantizationConfig. The
checkpoint's full-precision weights load as usual and
each linear layer quantizes its own once it is complete; the embedding and LM head stay as they are.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import ModelConfig, preset
from ..layers import RotaryEmbedding
from ..layers.quantization import get_quantization_config
from ..layers.quantization.gguf import GGUFConfig
from ..model_files import resolve_source
from ..models import get_model_class
from ..models.utils import process_weights_after_loading
from ..tokenizer import load_tokenizer
from . import gguf_loader, hf_loader

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


def load_model(source=None, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               load_format: str = "auto", tokenizer: bool = True, quantization=None):
    """-> (model in eval mode, its ModelConfig, its Tokenizer or None)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    quant_config = get_quantization_config(quantization)  # an unknown name fails before anything loads
    device = torch.device(device)
    if load_format == "dummy" and isinstance(quant_config, GGUFConfig):
        raise ValueError("quantization 'gguf' needs a .gguf file's weights, not load_format='dummy' "
                         "(use 'int4' or 'int8' for dummy weights)")
    if load_format == "dummy":
        return _dummy(source, dtype, device, quant_config)
    path = resolve_source(source)
    if path.is_file() and path.suffix == ".gguf":
        config = gguf_loader.read_config(path, name=path.stem)
        mapping = getattr(get_model_class(config.architecture), "stacked_params_mapping", ())
        if isinstance(quant_config, GGUFConfig):  # now the tensor types are known: which layers stay packed
            quant_config = quant_config.bind(path, gguf_loader.tensor_types(path), mapping)
        packed = quant_config if isinstance(quant_config, GGUFConfig) else None
        weights = gguf_loader.iter_weights(path, config, dtype, device, packed, mapping)
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and ggufs:
            return load_model(ggufs[0], dtype=dtype, device=device, tokenizer=tokenizer, quantization=quant_config)
        if isinstance(quant_config, GGUFConfig):
            raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks packed; {path} is not a .gguf file "
                             f"(use 'int8', 'int4' or another method for a Hugging Face checkpoint)")
        config = hf_loader.read_config(path)
        hf_loader.check_against_weights(path, config)
        weights = hf_loader.iter_weights(path, dtype, device)
    else:
        raise ValueError(f"cannot load a model from {path}: expected a .gguf file or a Hugging Face model folder")
    check_fits(config, dtype, device, quant_config, str(path))
    model = _build(config, dtype, device, quant_config)
    with torch.no_grad():
        model.load_weights(weights)  # ends with each layer's process_weights_after_loading
    tok = None
    if tokenizer:
        tok = load_tokenizer(path)
    if hasattr(quant_config, "process_model_after_loading"):  # AWQ/GPTQ: calibrate on text, now the weights are in
        quant_config.process_model_after_loading(model.eval(), tok if tok is not None else load_tokenizer(path))
    return model.eval(), config, tok


def _build(config: ModelConfig, dtype: torch.dtype, device: torch.device, quant_config=None):
    # Built straight on the target device in the target dtype: the layers allocate with torch.empty, so
    # no time goes into a random init that the checkpoint overwrites anyway, and the parameters keep
    # the attributes their layers gave them (weight_loader, ...), which a move between devices drops.
    with torch.device(device), default_dtype(dtype):
        model = get_model_class(config.architecture)(config, quant_config)
    model.dtype = dtype  # what it computes in: a packed layer's integers are not the model's dtype
    for module in model.modules():  # buffers (RoPE's cos/sin) are computed in fp32, never loaded
        if isinstance(module, RotaryEmbedding):
            module.compute_cache(device)
    return model


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _dummy(source, dtype, device, quant_config=None):
    """Random weights for any config, the way vLLM's load_format="dummy" works: for speed work (with a
    quant_config, the random full-precision weights are then quantized like loaded ones)."""
    config = read_model_config(source, dummy=True)
    where = f"preset {source!r}" if isinstance(source, str) and not Path(source).exists() else \
        config.name or "the model config"
    check_fits(config, dtype, device, quant_config, where)
    model = _build(config, dtype, device, quant_config)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # small values keep activations finite through many layers
                p.uniform_(-1e-2, 1e-2, generator=gen)
        process_weights_after_loading(model)
    if hasattr(quant_config, "process_model_after_loading"):  # AWQ/GPTQ on dummy weights: random calibration ids
        quant_config.process_model_after_loading(model.eval(), None)
    return model.eval(), config, None


def read_model_config(source=None, dummy: bool = False) -> ModelConfig:
    """The ModelConfig a load_model(source) would build, read without loading anything (a GGUF header
    or config.json; with dummy=True also a preset name or a ModelConfig)."""
    if isinstance(source, ModelConfig):
        return source
    if dummy and isinstance(source, str) and not Path(source).exists():
        return preset(source)
    path = resolve_source(source)
    if path.is_dir() and not (path / "config.json").is_file() and (ggufs := sorted(path.glob("*.gguf"))):
        path = ggufs[0]  # load_model's rule: a folder of GGUF files loads its first
    return _config_of(path)


def check_fits(config: ModelConfig, dtype: torch.dtype, device: torch.device, quant_config=None,
               where: str = "the model") -> None:
    """Refuse, before anything is allocated, a model that cannot fit the device's memory at all: its
    parameters (built on the "meta" device, which allocates nothing) and RoPE's cos/sin tables (fp32,
    one row per position) against the device's total memory. A lower bound: what passes may still
    not fit beside a KV cache, but what fails never could."""
    itemsize = 0.5 if quant_config is not None else torch.empty((), dtype=dtype).element_size()  # int4 at best
    params = config.num_params
    rope = 2 * 4 * config.max_position_embeddings * config.head_dim  # cos and sin, fp32
    need, total = params * itemsize + rope, _device_memory(torch.device(device))
    if total is None or need <= total:
        return
    gib = lambda n: f"{n / 2**30:,.1f} GiB"
    big = (f"max_position_embeddings={config.max_position_embeddings} (RoPE tables of {gib(rope)})"
           if rope > params * itemsize else f"{params:,} parameters in {str(dtype).removeprefix('torch.')} "
           f"(num_layers={config.num_layers}, hidden_size={config.hidden_size}, vocab_size={config.vocab_size})")
    raise ValueError(f"{where}: the model needs at least {gib(need)} for {big}, but {device} has {gib(total)} "
                     f"in all; use a smaller model, a smaller dtype or quantization, or a larger device")


def _device_memory(device: torch.device) -> int | None:
    """Total bytes of the device's memory (a CPU: physical memory, or the cgroup's limit if lower)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _config_of(path: Path) -> ModelConfig:
    if path.suffix == ".gguf":
        return gguf_loader.read_config(path, name=path.stem)
    return hf_loader.read_config(path)
