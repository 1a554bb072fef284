"""Filling a model from a checkpoint: one generic loop for every model family.

A checkpoint names tensors the Hugging Face way (`model.layers.3.self_attn.q_proj.weight`); a model
may stack several of them into one parameter (`qkv_proj` = q_proj, k_proj, v_proj). The model file
states only that table, vLLM's `packed_modules_mapping` seen from the checkpoint's side:

    stacked_params_mapping = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ...]
                               our parameter  checkpoint   shard id

and each parameter's `weight_loader` (set by its layer, layers/linear.py) puts a tensor, or one
shard of it, where it belongs. The loop proves the result: every parameter is filled exactly once
(a stacked one once per shard), so a missing, repeated or misshapen tensor is an error, never
silently random weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..layers.linear import ShapeMismatch, copy_checked


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    copy_checked(param.data, loaded_weight)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked_params_mapping: Iterable[tuple[str, str, object]] = (),
                 skip: Iterable[str] = ("rotary_emb.inv_freq",)) -> set[str]:
    """Copy (checkpoint name, tensor) pairs into `model`; returns what was filled ("name" or
    "name:shard"). Raises ValueError for a tensor with no place, a wrong shape, a tensor given twice, or
    a parameter (or shard) left empty."""
    params = dict(model.named_parameters())  # a tied parameter appears once, under its first name
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    mapping, skip = list(stacked_params_mapping), tuple(skip)
    done: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip) or name in tied:
            continue  # computed buffers (RoPE), and tied copies: the one tensor is loaded under its first name
        target, shard = name, None
        for param_name, weight_name, shard_id in mapping:
            if f".{weight_name}." in name:
                target, shard = name.replace(f".{weight_name}.", f".{param_name}."), shard_id
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        key = target if shard is None else f"{target}:{shard}"
        if key in done:
            raise ValueError(f"checkpoint tensor {name!r} is given twice (it fills {key} again)")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        except ShapeMismatch as e:
            raise ValueError(f"checkpoint tensor {name!r} has shape {e.got}, expected {e.want}") from None
        done.add(key)
    missing = sorted(expected_keys(model) - done)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    process_weights_after_loading(model)
    return done


def process_weights_after_loading(model: nn.Module) -> None:
    """Each layer's quant_method finishes its weights now that they are complete (a quantized layer
    quantizes or repacks them, layers/quantization/)."""
    for module in model.modules():
        if (method := getattr(module, "quant_method", None)) is not None:
            method.process_weights_after_loading(module)


def expected_keys(model: nn.Module) -> set[str]:
    """What a complete checkpoint fills: each parameter, or each shard of a stacked one (its layer's
    `shard_ids`)."""
    owner = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            owner[f"{mod_name}.{p_name}" if mod_name else p_name] = module
    keys = set()
    for name, _ in model.named_parameters():
        shard_ids = getattr(owner.get(name), "shard_ids", None)
        keys |= {f"{name}:{s}" for s in shard_ids} if shard_ids else {name}
    return keys
