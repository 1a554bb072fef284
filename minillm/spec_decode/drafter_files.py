"""A learned drafter on disk: a folder with config.json and model.safetensors (chapter 09, part two).

    config.json         {"method": "medusa" | "eagle", the shapes, and the target's sizes it was
                         trained on: hidden_size, vocab_size (checked against the target at load)}
    model.safetensors   the drafter's own weights only; what it shares with the target (the LM head,
                        the token embedding) is read from the target

`minillm train-drafter` writes one under the user's cache (default_drafter_dir); speculative_config
{"method": "medusa" | "eagle", "model": PATH} loads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def default_drafter_dir(method: str, model_name: str) -> Path:
    """~/.cache/minillm/drafters/<model>-<method> ($XDG_CACHE_HOME respected)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minillm" / "drafters"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(model_name)).name) or "model"
    return base / f"{safe}-{method}"


def save_drafter(folder, config: dict, module: torch.nn.Module) -> Path:
    """config.json + model.safetensors of module's own parameters (contiguous CPU copies)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in module.named_parameters()}
    save_file(tensors, str(folder / WEIGHTS))
    return folder


def read_drafter(folder, method: str, target_config) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (config, tensors) of a saved drafter, checked: its method and the target's sizes."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"speculative_config model {str(folder)!r}: a {method} drafter is a folder with "
                         f"{CONFIG} and {WEIGHTS} (minillm train-drafter writes one)")
    config = json.loads((folder / CONFIG).read_text())
    if config.get("method") != method:
        raise ValueError(f"speculative_config model {str(folder)!r} holds a {config.get('method')!r} drafter, "
                         f"not {method!r}")
    for key in ("hidden_size", "vocab_size"):
        if config.get(key) != getattr(target_config, key):
            raise ValueError(f"speculative_config model {str(folder)!r}: the drafter's {key} is {config.get(key)}, "
                             f"the target's {getattr(target_config, key)}; train one for this model")
    return config, load_file(str(folder / WEIGHTS))


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy every parameter of module from tensors (same names and shapes, nothing missing or left)."""
    own = dict(module.named_parameters())
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"{where}: weights missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"{where}: {name} is {tuple(tensors[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(tensors[name])
