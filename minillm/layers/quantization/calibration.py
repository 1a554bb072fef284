"""What AWQ and GPTQ share: calibration text, each linear layer's inputs, and the int4 grid they write.

Both methods look at real activations before they round a weight. The recipe, block by block:

    ids = calibration_ids(tokenizer, ...)          # N sequences x L tokens of the corpus's calibration part
    for each decoder layer (block) in order:
        capture the inputs x [T, K] of its linear layers (forward pre-hooks, minillm's own forward)
        quantize the block's layers from those inputs (AWQ: scales + clipping; GPTQ: error feedback)
        run the block again, now quantized: its output is the next block's input

Running blocks one at a time keeps only one block's activations in memory, and the next block is
calibrated on what the *quantized* model feeds it, so its method can make up for the earlier error
(GPTQ's "sequential" mode). Within a block, all four layers see the full-precision block's inputs.

Every quantized layer ends in the `int4` method's layout (qweight, scales, mins; utils.py and
kernels/w4a16.py), so AWQ and GPTQ run on the same W4A16 kernel as round-to-nearest: they choose
*which* grid points the weights land on, not how the weights are stored.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from ...data import load_corpus
from ...kernels.w4a16 import pack_int4
from ..attention import AttentionMetadata
from .base import UnquantizedLinearMethod
from .saved import load_quantized_tensors, read_config
from .weight_only import WeightOnlyConfig

# ---- the int4 grid: W ~ q * scale + min per group, q in 0..15 -----------------------------------


def group_range(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (lo, hi) [N, K/G]: each group's min and max (the round-to-nearest grid's range)."""
    N, K = w.shape
    wg = w.float().view(N, K // group_size, group_size)  # [N, groups, G]
    return wg.amin(dim=-1), wg.amax(dim=-1)


def grid_params(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's range -> (scales, mins) in the model's dtype, the values the kernel multiplies with."""
    return ((hi - lo) / 15).to(dtype), lo.to(dtype)


def quantize_to_grid(w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """w [N, G] (one group's columns, or one column with G=1) on the grid of (scales, mins) [N] or [N, 1]
    -> q [N, G] in 0..15 (float). A weight outside the range (a clipped one) lands on the end level."""
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round((w.float() - mins.float()) / s).clamp_(0, 15)


def dequantize_grid(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    return q * scales.float() + mins.float()


def quantize_with_range(w: torch.Tensor, group_size: int, lo: torch.Tensor, hi: torch.Tensor,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Round W [N, K] to the grid of each group's (lo, hi) [N, K/G] -> the int4 method's tensors."""
    N, K = w.shape
    scales, mins = grid_params(lo, hi, dtype)  # [N, groups]
    wg = w.float().view(N, K // group_size, group_size)
    q = quantize_to_grid(wg, scales[..., None], mins[..., None])  # [N, groups, G]
    return {"qweight": pack_int4(q.view(N, K)), "scales": scales, "mins": mins}


def check_group_size(method: str, group_size, allowed=(32, 64, 128)) -> None:
    if isinstance(group_size, bool) or group_size not in allowed:
        raise ValueError(f"quantization {method!r} group_size must be one of {', '.join(map(str, allowed))}, "
                         f"not {group_size!r}")


def check_divides(method: str, layer: nn.Module, K: int, group_size: int) -> None:
    if K % group_size:
        fits = [str(g) for g in (32, 64, 128) if K % g == 0]
        raise ValueError(f"quantization {method!r} group_size {group_size} does not divide the {K} input features "
                         f"of {getattr(layer, 'prefix', '') or type(layer).__name__}; group sizes that do: "
                         f"{', '.join(fits) or 'none'}")


# ---- calibration data ---------------------------------------------------------------------------


def calibration_ids(tokenizer, vocab_size: int, num_sequences: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """num_sequences windows of seq_len tokens from the corpus's calibration articles, spread evenly
    over the text (deterministic). Without a tokenizer (dummy weights), random token ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (num_sequences, seq_len), generator=g).tolist()
    ids = tokenizer.encode(load_corpus().calibration_text())
    if len(ids) < num_sequences * seq_len:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than num_sequences x seq_len = "
                         f"{num_sequences} x {seq_len}")
    step = len(ids) // num_sequences  # one window at the start of each of num_sequences equal stretches
    return [ids[i * step:i * step + seq_len] for i in range(num_sequences)]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    first = layers[0] if layers is not None and len(layers) else None
    if first is None or not all(hasattr(first, a) for a in ("input_layernorm", "self_attn", "mlp")) or \
            not hasattr(first.mlp, "gate_up_proj"):
        raise ValueError(f"AWQ/GPTQ calibrate Llama-style decoder layers (model.layers[i] with input_layernorm, "
                         f"self_attn.qkv_proj/o_proj and mlp.gate_up_proj/down_proj); {type(model).__name__} "
                         f"has another structure")
    return layers


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's four linear layers by short name."""
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


@contextmanager
def capture_inputs(linears: dict[str, nn.Module]):
    """Within the block, record each layer's input x [T, K] (fp32) as the forward runs."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(
        args[0].reshape(-1, args[0].shape[-1]).float())) for name, m in linears.items()]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def calibrate_blockwise(model: nn.Module, seqs: list[list[int]], quantize_block, desc: str,
                        num_blocks: int | None = None) -> None:
    """Run the calibration sequences through the model one decoder layer at a time; before each layer
    moves the activations on, `quantize_block(block, inputs)` quantizes it from its layers' inputs
    ({name: x [T, K]}). num_blocks: only the first so many (the tests' cheap runs); None: all."""
    layers = decoder_layers(model)
    inner = model.model
    device = next(model.parameters()).device
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], device=device)  # [T] all sequences packed
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    meta = AttentionMetadata.from_seq_lens(lens, device)
    with torch.inference_mode():
        x, residual = inner.embed_tokens(ids), None  # [T, hidden]
        cos_sin = inner.rotary_emb.cos_sin(positions, x.dtype)
        for block in tqdm(layers[:num_blocks], desc=desc, unit="layer"):
            with capture_inputs(block_linears(block)) as seen:
                block(positions, x, residual, meta, cos_sin)
            with torch.inference_mode(False), torch.no_grad():  # new parameters must not be inference tensors
                quantize_block(block, {name: torch.cat(xs).clone() for name, xs in seen.items()})
            x, residual = block(positions, x, residual, meta, cos_sin)  # the quantized block feeds the next


# ---- the config and method AWQ and GPTQ share ---------------------------------------------------


class CalibratedLinearMethod(UnquantizedLinearMethod):
    """Keeps the layer's full-precision weight after loading: the model-level calibration
    (CalibratedConfig.process_model_after_loading) needs it, then turns the layer into an int4 one."""

    def __init__(self, config: CalibratedConfig):
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        if self.config.group_size is not None:  # None: an int8 (per channel) saved result
            check_divides(self.config.name, layer, input_size_per_partition, self.config.group_size)
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def apply(self, layer, x, bias=None):
        if not self.config.calibrating:  # never serve full-precision weights under a quantized name
            raise RuntimeError(f"{layer.prefix} ({self.config.name!r}) is not calibrated yet: load the model through "
                               f"load_model()/LLM(), which calibrate it after loading")
        return super().apply(layer, x, bias)


class CalibratedConfig(WeightOnlyConfig):
    """What AWQ and GPTQ share: group size, calibration size, or a saved result to load instead."""

    def __init__(self, group_size: int, num_sequences: int | None, seq_len: int | None, path):
        check_group_size(self.name, group_size)
        for name, value in (("num_sequences", num_sequences), ("seq_len", seq_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"quantization {self.name!r} {name} must be None or a positive int, not {value!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"quantization {self.name!r} path must be a folder written by `minillm quantize`, "
                             f"not {path!r}")
        self.group_size, self.num_sequences, self.seq_len = group_size, num_sequences, seq_len
        self.path = None if path is None else str(path)
        self.calibrating = False

    def method(self):
        return CalibratedLinearMethod(self)

    def quantize_block(self, block: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def calibration_size(self, device: torch.device, max_len: int) -> tuple[int, int]:
        gpu = device.type == "cuda"
        n = self.num_sequences or (64 if gpu else 16)
        L = self.seq_len or min(512 if gpu else 256, max_len)
        if L > max_len:
            raise ValueError(f"quantization {self.name!r} seq_len {L} is longer than the model's {max_len} positions")
        return n, L

    def process_model_after_loading(self, model: nn.Module, tokenizer) -> None:
        """After the checkpoint is in: load the saved result (path), or calibrate on the corpus."""
        if self.path is not None:
            load_quantized_tensors(model, self.path, self)
            return
        decoder_layers(model)  # a clear error for a structure we cannot calibrate, before any work
        n, L = self.calibration_size(next(model.parameters()).device, model.config.max_position_embeddings)
        seqs = calibration_ids(tokenizer, model.config.vocab_size, n, L)
        self.calibrating = True
        try:
            calibrate_blockwise(model, seqs, self.quantize_block, desc=f"{self.name} calibration ({n} x {L} tokens)")
        finally:
            self.calibrating = False


# ---- a saved result: a folder `minillm quantize` wrote (its format: saved.py) ----------------------


class QuantizedCheckpointConfig(WeightOnlyConfig):
    """A folder written by `minillm quantize` (any method): the model loads its checkpoint in full
    precision, then takes the folder's tensors. `load_quantized(path)` makes one."""

    name = "quantized"
    options = ("path",)

    def __init__(self, path):
        self.path = str(path)
        self.saved = read_config(path)
        self.group_size = self.saved["group_size"]
        self.calibrating = False  # the layers never run before the saved tensors are in

    def method(self):
        return CalibratedLinearMethod(self)

    def process_model_after_loading(self, model: nn.Module, tokenizer) -> None:
        load_quantized_tensors(model, self.path)


def load_quantized(path: str | os.PathLike, lm_head: str = "int8") -> QuantizedCheckpointConfig:
    """A folder written by `minillm quantize` -> the config `LLM(quantization=...)` loads it with.
    lm_head: the LM head's format, which the folder does not hold (it comes from the original checkpoint,
    quantized at load: lm_head.py), "int8" or "none" (the model's dtype)."""
    return QuantizedCheckpointConfig.from_options(path=path, lm_head=lm_head)
