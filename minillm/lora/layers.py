"""Linear layers with LoRA: the base layer's output plus each token's adapter update (chapter 16;
vLLM's names: ColumnParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA,
QKVParallelLinearWithLoRA, RowParallelLinearWithLoRA).

A wrapped layer keeps the base layer (its weights, its quant_method) and adds max_loras adapter
slots, for each of its S stacked output parts (q, k, v of qkv_proj; gate, up of gate_up_proj; the
whole output otherwise; R = max_lora_rank, a smaller adapter zero-padded):

    lora_a  [max_loras, S * R, in]     rows i*R .. (i+1)*R: A of part i (the parts share x)
    lora_b  [max_loras, out, R]        rows of part i: its B, the scaling folded in

and its forward pass is

    y = base(x)                                                    [T, out]
    y[:, part i] += (x . A_i[slot]^T) . B_i[slot]^T   per token, every part in one shrink and one
                                                      expand launch (kernels/lora_bgmv.py)

with slot = the forward context's `lora_mapping` [T] (-1: no adapter). Without a context, or with
no mapping (a step where nobody has an adapter, a notebook running the model alone) the layer is
its base layer. The slot buffers are allocated once and written in place (`set_lora`), so a CUDA
graph captured over them stays valid when an adapter is swapped into a slot.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_context import maybe_forward_context
from ..kernels.lora_bgmv import add_lora, add_lora_ref
from ..layers.backend import use_triton
from ..layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from .adapter import LoRAModel, lora_targets


class BaseLinearLayerWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype):
        super().__init__()
        if base_layer.tp_size > 1:
            raise ValueError("LoRA with tensor parallelism is not supported yet (tensor_parallel_size must be 1)")
        self.base_layer = base_layer
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        sizes = base_layer.output_partition_sizes  # [out_i] per stacked part
        self.slices = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]  # (offset, size) in y
        self.slice_offsets = tuple(offset for offset, _ in self.slices)
        k, R = base_layer.input_size_per_partition, max_lora_rank
        device = next(base_layer.parameters()).device
        self.lora_a = torch.zeros(max_loras, len(sizes) * R, k, dtype=dtype, device=device)  # [L, S * R, in]
        self.lora_b = torch.zeros(max_loras, sum(sizes), R, dtype=dtype, device=device)  # [L, out, R]

    def set_lora(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's (A [r, in], B [out_i, r]) per part into a slot, in place; parts it does
        not target, and the ranks past r, are zero (they add nothing)."""
        R = self.max_lora_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (a, b) in parts.items():
            offset, n = self.slices[i]
            r = a.shape[0]
            self.lora_a[slot, i * R : i * R + r].copy_(a)  # [r, in]
            self.lora_b[slot, offset : offset + n, :r].copy_(b)  # [out_i, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # [T, out]
        ctx = maybe_forward_context()
        slots = ctx.lora_mapping if ctx is not None else None  # [T] int32 or None
        if slots is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [T, in], [T, out]
        if slots.shape[0] != x2.shape[0]:
            raise ValueError(f"lora_mapping has {slots.shape[0]} slots for {x2.shape[0]} tokens")
        add = add_lora if use_triton(x2) else add_lora_ref
        add(y2, x2, self.lora_a, self.lora_b, slots, self.slice_offsets)  # every part of y, two launches
        return y

    def extra_repr(self) -> str:
        return f"max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}, parts={len(self.slices)}"


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    pass


class QKVParallelLinearWithLoRA(MergedColumnParallelLinearWithLoRA):
    pass


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


def _lora_class(layer: nn.Module) -> type[BaseLinearLayerWithLoRA]:
    for base, cls in ((QKVParallelLinear, QKVParallelLinearWithLoRA),
                      (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
                      (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
                      (RowParallelLinear, RowParallelLinearWithLoRA)):
        if isinstance(layer, base):
            return cls
    raise TypeError(f"no LoRA layer for {type(layer).__name__}")


def wrap_lora_layers(model: nn.Module, max_loras: int, max_lora_rank: int) -> dict[str, BaseLinearLayerWithLoRA]:
    """Replace every linear layer an adapter may target (adapter.lora_targets) by its LoRA layer, in
    place, after the weights are loaded; -> {layer name: LoRA layer}. The slots start empty (zeros)."""
    # the activations' dtype: a norm's weight is never quantized (a linear's may be int8 or fp8)
    dtype = next((p.dtype for p in model.parameters() if p.dtype in (torch.float32, torch.bfloat16, torch.float16)),
                 torch.get_default_dtype())
    wrapped = {}
    for name in sorted({t.module for t in lora_targets(model).values()}):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr)
        if isinstance(layer, BaseLinearLayerWithLoRA):
            wrapped[name] = layer
            continue
        wrapped[name] = lora = _lora_class(layer)(layer, max_loras, max_lora_rank, dtype)
        setattr(parent, attr, lora)
    return wrapped


def set_adapter(layers: dict[str, BaseLinearLayerWithLoRA], slot: int, lora: LoRAModel | None) -> None:
    """Load one adapter (None: clear the slot) into a GPU slot of every LoRA layer."""
    for name, layer in layers.items():
        layer.set_lora(slot, lora.layers.get(name, {}) if lora is not None else {})
