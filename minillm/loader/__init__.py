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

from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import ModelConfig, preset
from ..layers import RotaryEmbedding
from ..layers.quantization import GGUFConfig, get_quantization_config
from ..model_files import resolve_source
from ..models import get_model_class
from ..models.utils import process_weights_after_loading

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
        from . import gguf_loader

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
        from . import hf_loader

        config = hf_loader.read_config(path)
        weights = hf_loader.iter_weights(path, dtype, device)
    else:
        raise ValueError(f"cannot load a model from {path}: expected a .gguf file or a Hugging Face model folder")
    model = _build(config, dtype, device, quant_config)
    with torch.no_grad():
        model.load_weights(weights)  # ends with each layer's process_weights_after_loading
    tok = None
    if tokenizer:
        from ..tokenizer import load_tokenizer

        tok = load_tokenizer(path)
    if hasattr(quant_config, "process_model_after_loading"):  # AWQ/GPTQ: calibrate on text, now the weights are in
        from ..tokenizer import load_tokenizer

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
    if isinstance(source, ModelConfig):
        config = source
    elif isinstance(source, str) and not Path(source).exists():
        config = preset(source)
    else:
        path = resolve_source(source)
        config = _config_of(path)
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


def _config_of(path: Path) -> ModelConfig:
    if path.suffix == ".gguf":
        from . import gguf_loader

        return gguf_loader.read_config(path, name=path.stem)
    from . import hf_loader

    return hf_loader.read_config(path)
