"""A LoRA adapter in PEFT's format, read and checked against the base model (chapter 16).

A PEFT adapter folder holds `adapter_config.json` (rank r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, with two matrices per targeted linear layer W [out, in]:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B [out, r]

and the layer computes y = x W^T + scaling * (x A^T) B^T, scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). minillm stacks q, k and v into one qkv_proj and gate, up into gate_up_proj
(models/llama.py), so an adapter of q_proj lands on slice 0 of qkv_proj's output, v_proj on slice 2:
`lora_targets` reads that map off the model's own `stacked_params_mapping`. The scaling is folded
into B once, here, so the kernels multiply by nothing (vLLM does the same).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .request import LoRARequest

# the checkpoint names of the linear layers an adapter may target (Llama-family attention and MLP)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoRATarget:
    module: str  # our layer, e.g. "model.layers.0.self_attn.qkv_proj"
    slice: int  # which stacked part of its output: q, k, v = 0, 1, 2; gate, up = 0, 1; else 0
    in_features: int
    out_features: int  # of that part


def lora_targets(model) -> dict[str, LoRATarget]:
    """Checkpoint module name ("model.layers.0.self_attn.q_proj") -> where its update lands in our
    model. Works on a model whose layers are already LoRA-wrapped (layers.py: .base_layer)."""
    mapping = getattr(model, "stacked_params_mapping", ())
    out = {}
    for name, m in model.named_modules():
        layer = getattr(m, "base_layer", m)
        if name.endswith(".base_layer") or not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            continue
        stem, _, last = name.rpartition(".")
        parts = [(ckpt, shard) for ours, ckpt, shard in mapping if ours == last and ckpt in SUPPORTED_MODULES]
        for ckpt, shard in parts:  # a stacked layer: one target per part
            i = layer.shard_ids.index(shard)
            out[f"{stem}.{ckpt}"] = LoRATarget(name, i, layer.input_size, layer.output_sizes[i])
        if not parts and last in SUPPORTED_MODULES:
            out[name] = LoRATarget(name, 0, layer.input_size, layer.output_size)
    return out


@dataclass
class LoRAModel:
    """One adapter on the CPU, ready to copy into a GPU slot (vLLM's name)."""

    id: int
    name: str
    rank: int
    scaling: float
    # our layer -> {slice: (A [r, in], B [out, r] with the scaling folded in)}, fp32 on the CPU
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for parts in self.layers.values() for a, b in parts.values())


def _refuse_unsupported(cfg: dict, what: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{what}: peft_type must be 'LORA', not {cfg.get('peft_type')!r}")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False}
    for key, default in unsupported.items():
        if cfg.get(key, default) not in (default, None):
            raise ValueError(f"{what}: {key}={cfg[key]!r} is not supported (only plain LoRA)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{what}: bias={cfg['bias']!r} is not supported, only 'none'")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{what}: {key} is not supported (one rank and one lora_alpha for all "
                             f"layers, no full modules): got {cfg[key]!r}")


def _check_target_modules(cfg: dict, what: str) -> None:
    tm = cfg.get("target_modules")
    if isinstance(tm, str):  # "all-linear", or a regular expression PEFT matched: the weights tell
        return
    if not isinstance(tm, list) or not tm:
        raise ValueError(f"{what}: target_modules must be a non-empty list or a str, not {tm!r}")
    for t in tm:
        if not isinstance(t, str) or t.rpartition(".")[2] not in SUPPORTED_MODULES:
            raise ValueError(f"{what}: target module {t!r} is not supported; allowed: {', '.join(SUPPORTED_MODULES)}")


def lora_scaling(r: int, lora_alpha: float, use_rslora: bool) -> float:
    """The factor on B A: lora_alpha / r (Hu et al.), or lora_alpha / sqrt(r) with rsLoRA (Kalajdzievski),
    under which the update's size does not shrink as the rank grows."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def read_adapter_config(path: str, what: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"{what}: lora_path {path!r} is not a folder (want a PEFT adapter folder with "
                         f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    for f in (CONFIG_NAME, WEIGHTS_NAME):
        if not os.path.isfile(os.path.join(path, f)):
            raise ValueError(f"{what}: lora_path {path!r} has no {f}")
    try:
        with open(os.path.join(path, CONFIG_NAME)) as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: {CONFIG_NAME} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{what}: {CONFIG_NAME} must hold a JSON object")
    return cfg


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int) -> LoRAModel:
    """Read and check one adapter folder: -> LoRAModel (fp32, CPU). A ValueError names what is wrong:
    a missing folder or file, a rank above max_lora_rank, an unknown target module, a tensor whose
    shape is not the base model's layer (an adapter trained for another model)."""
    from safetensors.torch import load_file  # lazy: only adapters need it

    what = f"LoRA adapter {request.lora_name!r}"
    cfg = read_adapter_config(request.lora_path, what)
    _refuse_unsupported(cfg, what)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{what}: r must be a positive int, not {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"{what}: rank r={r} is above max_lora_rank={max_lora_rank}; raise max_lora_rank "
                         f"(LLM(..., max_lora_rank={r}))")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{what}: lora_alpha must be a number, not {alpha!r}")
    _check_target_modules(cfg, what)
    scaling = lora_scaling(r, alpha, bool(cfg.get("use_rslora")))
    try:
        tensors = load_file(os.path.join(request.lora_path, WEIGHTS_NAME))
    except Exception as e:  # a truncated or foreign file: safetensors raises its own types
        raise ValueError(f"{what}: {WEIGHTS_NAME} cannot be read: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{what}: tensor {key!r} is not a lora_A/lora_B weight (embeddings, biases and "
                             "full modules are not supported)")
        module = m["module"]
        if module not in targets:
            if module.rpartition(".")[2] in SUPPORTED_MODULES:
                raise ValueError(f"{what} does not fit the base model: it has {module!r}, which this model "
                                 "lacks (an adapter trained for another model?)")
            raise ValueError(f"{what}: target module {module!r} is not supported; allowed: "
                             f"{', '.join(SUPPORTED_MODULES)}")
        pairs.setdefault(module, {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"{what}: {WEIGHTS_NAME} holds no lora_A/lora_B weights")
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{what}: {module} has {sorted(ab)} but needs both lora_A and lora_B")
        tgt = targets[module]
        for kind, t, want in (("lora_A", ab["lora_A"], (r, tgt.in_features)),
                              ("lora_B", ab["lora_B"], (tgt.out_features, r))):
            if tuple(t.shape) != want:
                raise ValueError(f"{what} does not fit the base model: {module}.{kind} has shape "
                                 f"{tuple(t.shape)}, this model (rank r={r}) wants {want}")
        a = ab["lora_A"].float()  # [r, in]
        b = ab["lora_B"].float() * scaling  # [out, r]: the scaling folded in once
        layers.setdefault(tgt.module, {})[tgt.slice] = (a.contiguous(), b.contiguous())
    return LoRAModel(request.lora_int_id, request.lora_name, r, scaling, layers)
