"""Loading a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.json.

safetensors is a flat header of names, dtypes and offsets followed by raw tensor bytes, so each
tensor is read straight into memory in its stored dtype and converted on the target device, one at
a time: the host never holds the whole model in fp32. Pickle checkpoints (*.bin, *.pt) are refused:
loading one runs arbitrary code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import ModelConfig


def read_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path.parent}: a config file is not valid JSON ({e})") from e
    return ModelConfig.from_hf(cfg, gen, name=folder.name)


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
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
    from safetensors import SafetensorError, safe_open

    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(device=device, dtype=dtype)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
