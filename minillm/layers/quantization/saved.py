"""The folder `minillm quantize` writes and `LLM(quantization=load_quantized(path))` reads.

    save_quantized(model, "smollm2-awq-g64", "awq", {"group_size": 64}, source)   # a quantized model -> folder
    load_quantized_tensors(model, "smollm2-awq-g64")                             # folder -> the model's layers

(`minillm/quantize.py` holds the CLI verbs around these; `calibration.load_quantized` the config that
loads a folder.) A saved folder holds `quant_config.json` (the method, its options, bits, group size
and the shape of the model it was made from) and `model.safetensors` with what quantizing changed:
each linear layer's packed tensors (int4: qweight uint8 [N, K/2], scales and mins [N, K/G]; int8:
qweight int8 [N, K], scales [N]) and biases, and every RMSNorm weight (AWQ divides them by its
scales). The rest (embedding, LM head) comes from the original checkpoint, loaded as usual: the
folder is a delta over the model it names, like a LoRA adapter.

Loading checks everything before it changes anything: the model's shape must match the JSON, every
tensor must be there, with its name, shape and integer dtype; a mismatch (or a file that is not
safetensors at all) is a ValueError naming the file or the tensor. Scales and mins take the model's
dtype (a bf16 save loads into fp32 exactly).

Writing never destroys anything: `check_out` refuses, before the model is loaded, an --out that is
a file, not writable, the model's own folder (or inside it, or around it), or a folder that is not
empty unless overwrite is asked for; the folder is written under a temporary name beside it and
renamed into place once complete, so a crash leaves the old folder (or none), never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...model_files import embedded_model_path
from ..layernorm import RMSNorm
from ..linear import LinearBase, QKVParallelLinear, RowParallelLinear
from .int4 import become_int4
from .int8 import Int8LinearMethod

FORMAT = "minillm-quantized"
CONFIG_FILE, TENSORS_FILE = "quant_config.json", "model.safetensors"
METHODS = ("awq", "gptq", "int4", "int8")


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


def _fingerprint(model: nn.Module) -> dict:
    c = model.config
    return {"architecture": c.architecture, "hidden_size": c.hidden_size, "num_layers": c.num_layers,
            "vocab_size": c.vocab_size, "intermediate_size": c.intermediate_size}


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a quantized model's folder holds: every linear layer's parameters and every norm's weight."""
    out, linears = {}, _linears(model)
    for name, module in model.named_modules():
        if name in linears or isinstance(module, RMSNorm):
            for p_name, p in module.named_parameters(recurse=False):
                out[f"{name}.{p_name}"] = p.detach().contiguous().cpu()
    return out


def check_out(out: str | Path, model: str | Path | None = None, overwrite: bool = False) -> Path:
    """Where `minillm quantize` may write, checked before anything loads: -> the folder's absolute path.
    Refused: a file; the model's own folder, a folder inside it or one holding it; a folder that is not
    empty (unless overwrite); the working directory, a folder holding it, or the home directory (the
    old folder is deleted when replaced); a place this user cannot create a folder in."""
    out = Path(out).expanduser().absolute()
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise ValueError(f"--out {out} is a file; quantize writes a folder (quant_config.json, {TENSORS_FILE})")
    source = _model_path(model)
    if source is not None:
        here = source if source.is_dir() else source.parent
        real_out, real_here = Path(os.path.realpath(out)), Path(os.path.realpath(here))
        if real_out == real_here or real_here in real_out.parents:
            raise ValueError(f"--out {out} is inside the model's folder {here}: writing there would replace the "
                             f"model's own files; choose a folder outside it")
        if real_out in real_here.parents and out.is_dir():  # overwriting it would delete the model
            raise ValueError(f"--out {out} holds the model {source}; choose a folder outside it")
    if out.is_dir():  # replacing moves the folder aside and deletes it: never where a shell or a user lives
        real_out, cwd = Path(os.path.realpath(out)), Path(os.path.realpath(Path.cwd()))
        if real_out == cwd or real_out in cwd.parents:
            raise ValueError(f"--out {out} is the working directory or holds it: quantize replaces the folder "
                             f"whole, which would delete it; name a new folder in it (--out ./quantized)")
        if real_out == Path(os.path.realpath(Path.home())):
            raise ValueError(f"--out {out} is the home directory: quantize replaces the folder whole; name a new "
                             f"folder in it")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} is not empty; choose a new folder, or pass --overwrite to replace it")
    parent = next(p for p in out.parents if p.exists())  # where the folder (and its parents) will be made
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot create a folder in {parent} (not a writable folder)")
    if out.is_dir() and not os.access(out.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot replace it, {out.parent} is not writable")
    return out


def _model_path(model) -> Path | None:
    """The local file or folder a --model names (None: a hub id, which is never a local folder)."""
    if model is None:
        try:
            return embedded_model_path().absolute()
        except FileNotFoundError:
            return None
    path = Path(model).expanduser()
    return path.absolute() if path.exists() else None


def save_quantized(model: nn.Module, out: str | Path, method: str, options: dict, source: str | None,
                   overwrite: bool = False) -> Path:
    """Write a quantized model's folder (see the module docstring): into a temporary folder beside
    `out`, renamed to `out` once complete. An existing non-empty `out` is replaced only with overwrite."""
    layers = _linears(model)
    if not layers or any(not hasattr(m, "qweight") for m in layers.values()):
        raise ValueError("save_quantized needs a model whose linear layers are all quantized (qweight)")
    bits = 4 if all(hasattr(m, "mins") for m in layers.values()) else 8
    out = check_out(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file(saved_tensors(model), str(tmp / TENSORS_FILE))
        config = {"format": FORMAT, "version": 1, "method": method, "bits": bits, "options": options,
                  "group_size": options.get("group_size") if bits == 4 else None,
                  "model": _fingerprint(model), "source": source}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from everyone else
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(new: Path, out: Path) -> None:
    """Put the complete folder `new` at `out`: a rename, after moving an old `out` aside (and then
    deleting it), so `out` is at every moment either the old folder or the new one."""
    if not out.exists():
        os.rename(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rename(out, old / "x")
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old / "x", out)  # put the old one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def read_config(path: str | Path) -> dict:
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{path} is not a folder written by `minillm quantize` (no {CONFIG_FILE})")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT or config.get("method") not in METHODS:
        raise ValueError(f"{file} is not a {FORMAT} config with a method in {METHODS}")
    if config.get("bits") not in (4, 8) or (config["bits"] == 4 and config.get("group_size") not in (32, 64, 128)):
        raise ValueError(f"{file}: bits must be 4 (with group_size 32, 64 or 128) or 8, got bits={config.get('bits')!r} "
                         f"group_size={config.get('group_size')!r}")
    fingerprint = config.get("model")
    if not isinstance(fingerprint, dict) or set(fingerprint) != {"architecture", "hidden_size", "num_layers",
                                                                  "vocab_size", "intermediate_size"}:
        raise ValueError(f"{file}: 'model' must describe the model it was made from (architecture, hidden_size, "
                         f"num_layers, vocab_size, intermediate_size), not {fingerprint!r}")
    config.setdefault("group_size", None)
    if not (path / TENSORS_FILE).is_file():
        raise ValueError(f"{path} has {CONFIG_FILE} but no {TENSORS_FILE}: an incomplete folder")
    return config


def rank_part(layer: LinearBase, t: torch.Tensor) -> torch.Tensor:
    """A saved (TP = 1) tensor of `layer` -> this rank's part, cut as the layer's weight_loader cuts a
    checkpoint's (chapter 11): a row-parallel layer keeps its columns of a per-input tensor (qweight
    [N, K/2], scales/mins [N, K/G]; an int8 scale [N] and the bias are whole rows, kept); a
    column-parallel one keeps, in each stacked part (q/k/v, gate/up), its rows (whole heads: a KV head
    replicated over ranks when there are fewer than ranks)."""
    tp, rank = layer.tp_size, layer.tp_rank
    if tp == 1:
        return t
    if isinstance(layer, RowParallelLinear):
        if t.dim() == 1:
            return t
        k = t.shape[1] // tp
        return t.narrow(1, rank * k, k)
    parts, out = t.split(layer.output_sizes, dim=0), []  # the stacked parts at TP = 1
    for i, (part, size) in enumerate(zip(parts, layer.output_partition_sizes)):
        owner = rank // layer.num_kv_head_replicas if isinstance(layer, QKVParallelLinear) and i > 0 else rank
        out.append(part.narrow(0, owner * size, size))
    return torch.cat(out, dim=0)


def load_quantized_tensors(model: nn.Module, path: str | Path, quant_config=None) -> None:
    """Replace the model's full-precision linear weights (and norms) by a saved folder's tensors."""
    config = read_config(path)
    if quant_config is not None and getattr(quant_config, "name", None) in ("awq", "gptq") and \
            (config["method"] != quant_config.name or config["group_size"] != quant_config.group_size):
        raise ValueError(f"{path} holds {config['method']} g{config['group_size']}, not the requested "
                         f"{quant_config.name} g{quant_config.group_size}")
    if config["model"] != _fingerprint(model):
        raise ValueError(f"{path} was made for a model of shape {config['model']}, not {_fingerprint(model)}")
    file = Path(path) / TENSORS_FILE
    try:
        tensors = load_file(str(file), device=str(next(model.parameters()).device))
    except Exception as e:  # safetensors' own error: a truncated or overwritten file
        raise ValueError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    bits, G = config["bits"], config["group_size"]
    want = {}  # name -> (shape, dtype or None for "the model's float dtype")
    for name, layer in _linears(model).items():
        N, K = layer.output_size, layer.input_size  # the whole layer's: a folder is written at TP = 1
        if bits == 4:
            want |= {f"{name}.qweight": ((N, K // 2), torch.uint8), f"{name}.scales": ((N, K // G), None),
                     f"{name}.mins": ((N, K // G), None)}
        else:
            want |= {f"{name}.qweight": ((N, K), torch.int8), f"{name}.scales": ((N,), None)}
        if layer.bias is not None:
            want[f"{name}.bias"] = ((N,), None)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            want[f"{name}.weight"] = (tuple(module.weight.shape), None)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{path} does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype) or (dtype is None and not t.is_floating_point()):
            raise ValueError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                             f"{dtype or 'a float dtype'} {shape}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, layer in _linears(model).items():
            dtype = layer.weight.dtype
            q = {k: rank_part(layer, tensors[f"{name}.{k}"] if k == "qweight" else tensors[f"{name}.{k}"].to(dtype))
                 for k in (("qweight", "scales", "mins") if bits == 4 else ("qweight", "scales"))}
            if layer.bias is not None:
                layer.bias.copy_(rank_part(layer, tensors[f"{name}.bias"]))
            if bits == 4:
                become_int4(layer, q, G)
            else:
                del layer.weight
                for k, t in q.items():
                    layer.register_parameter(k, nn.Parameter(t, requires_grad=False))
                layer.quant_method = Int8LinearMethod()
        for name, module in model.named_modules():
            if isinstance(module, RMSNorm):
                params[f"{name}.weight"].copy_(tensors[f"{name}.weight"])
