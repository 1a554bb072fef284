"""Loading a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.json.

safetensors is a flat header of names, dtypes and offsets followed by raw tensor bytes, so each
tensor is read straight into memory in its stored dtype and converted on the target device, one at
a time: the host never holds the whole model in fp32. Pickle checkpoints (*.bin, *.pt) are refused:
loading one runs arbitrary code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from ..config import LIMITS, MLA_LIMITS, MOE_LIMITS, ModelConfig

# config.json fields that are sizes or counts: an int, or absent/null where the config allows it
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings",
               "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
               "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
# config.json's name -> its bound (config.LIMITS, under ModelConfig's names), checked on the raw JSON:
# reading a config of 10^12 layers must not first build lists of that length
_LIMITS = {"vocab_size": LIMITS["vocab_size"], "hidden_size": LIMITS["hidden_size"],
           "intermediate_size": LIMITS["intermediate_size"], "num_hidden_layers": LIMITS["num_layers"],
           "num_attention_heads": LIMITS["num_heads"], "num_key_value_heads": LIMITS["num_kv_heads"],
           "head_dim": LIMITS["head_dim"], "max_position_embeddings": LIMITS["max_position_embeddings"],
           "num_local_experts": MOE_LIMITS["num_experts"], "num_experts": MOE_LIMITS["num_experts"],
           "n_routed_experts": MOE_LIMITS["num_experts"], "num_experts_per_tok": MOE_LIMITS["num_experts_per_tok"],
           "moe_intermediate_size": MOE_LIMITS["moe_intermediate_size"], **MLA_LIMITS}


def read_config(folder: Path) -> ModelConfig:
    """config.json (and generation_config.json, when there is one) -> ModelConfig; every error names
    the file and the field."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    cfg = _read_json_object(cfg_path)
    gen_path = folder / "generation_config.json"
    gen = _read_json_object(gen_path) if gen_path.is_file() else None
    for key in _INT_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{cfg_path}: {key} must be an int, not {type(value).__name__} ({value!r})")
        if value is not None and key in _LIMITS and value > _LIMITS[key]:
            raise ValueError(f"{cfg_path}: {key}={value} is beyond what minillm accepts (at most {_LIMITS[key]:,}); "
                             f"a config that large is a mistake, or not a model this engine can hold")
    for key in _FLOAT_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{cfg_path}: {key} must be a number, not {type(value).__name__} ({value!r})")
    try:
        return ModelConfig.from_hf(cfg, gen, name=folder.name)
    except KeyError as e:
        raise ValueError(f"{cfg_path}: the field {e.args[0]!r} is missing, and the model cannot be built without it") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {e}") from e


def tensor_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's name -> (shape, its file), from the safetensors headers only (nothing is read)."""
    out = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    out[name] = (tuple(f.get_slice(name).get_shape()), path)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
    return out


def check_against_weights(folder: Path, config: ModelConfig) -> None:
    """config.json against the checkpoint's tensor shapes (headers only), before anything is allocated:
    the embedding, the number of layers, the first layer's attention and MLP. A mismatch names
    config.json's field, its value and what the tensor holds."""
    shapes, cfg = tensor_shapes(folder), folder / "config.json"
    c = config

    def expect(name: str, want: tuple, fields: str) -> None:
        got = shapes.get(name)
        if got is not None and got[0] != want:
            raise ValueError(f"{cfg}: {fields} say {name} is {list(want)}, but {got[1].name} holds {list(got[0])}")

    expect("model.embed_tokens.weight", (c.vocab_size, c.hidden_size),
           f"vocab_size={c.vocab_size} and hidden_size={c.hidden_size}")
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers and max(layers) + 1 < c.num_layers:
        raise ValueError(f"{cfg}: num_hidden_layers={c.num_layers}, but the checkpoint holds layers 0 to {max(layers)} "
                         f"only ({len(layers)} layers)")
    if c.mla is None:
        attn = "model.layers.0.self_attn"
        expect(f"{attn}.q_proj.weight", (c.num_heads * c.head_dim, c.hidden_size),
               f"num_attention_heads={c.num_heads} x head_dim={c.head_dim} and hidden_size={c.hidden_size}")
        expect(f"{attn}.k_proj.weight", (c.num_kv_heads * c.head_dim, c.hidden_size),
               f"num_key_value_heads={c.num_kv_heads} x head_dim={c.head_dim} and hidden_size={c.hidden_size}")
    dense = next((i for i in range(c.num_layers) if f"model.layers.{i}.mlp.gate_proj.weight" in shapes), None)
    if dense is not None:
        expect(f"model.layers.{dense}.mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size),
               f"intermediate_size={c.intermediate_size} and hidden_size={c.hidden_size}")


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if weight_map is None:
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> shard file): a corrupt shard index")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file name, "
                             f"not {type(weight_map).__name__} ({str(weight_map)[:80]})")
        for name, shard in weight_map.items():
            _check_shard_name(index, name, shard)
        files = [folder / s for s in sorted(set(weight_map.values()))]
        missing = [str(f.relative_to(folder)) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        why = f" (found {pickles[:3]}: pickle files are not loaded, they can run code)" if pickles else ""
        raise FileNotFoundError(f"{folder} has no *.safetensors weights{why}")
    return files


def iter_weights(folder: Path, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint once. A name found in two shard files is an error before any is
    read: which copy is the weight would depend on the order of the files."""
    files = weight_files(folder)
    where: dict[str, Path] = {}  # tensor name -> the shard that holds it (headers only)
    for path in files:
        for name in _shard_keys(path, safe_open, SafetensorError):
            if name in where:
                raise ValueError(f"{folder}: tensor {name!r} is in two shards, {where[name].name} and {path.name}; "
                                 f"a checkpoint must hold each tensor once")
            where[name] = path
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(device=device, dtype=dtype)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e


def _shard_keys(path: Path, safe_open, error) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except error as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from e


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object ({{...}}), not a JSON {type(data).__name__}")
    return data


def _check_shard_name(index: Path, name, shard) -> None:
    """A shard is a file inside the model folder: a relative name that never climbs out of it (an index
    naming "../x" or "/etc/x" would make the loader read files the folder's owner did not give)."""
    if not isinstance(shard, str) or not shard:
        raise ValueError(f"{index}: weight_map[{name!r}] must be a shard file name, not {shard!r}")
    posix, windows = PurePosixPath(shard), PureWindowsPath(shard)
    if posix.is_absolute() or windows.drive or windows.root or "\\" in shard or ".." in posix.parts:
        raise ValueError(f"{index}: weight_map[{name!r}] is {shard!r}, outside the model folder; shard names must be "
                         f"relative file names inside it")
