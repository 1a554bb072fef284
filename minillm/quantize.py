"""`minillm quantize`: quantize a model once, save the result, load it without calibrating again.

    minillm quantize --method awq --group-size 64 --out smollm2-awq-g64      # calibrates, then saves
    LLM(quantization=load_quantized("smollm2-awq-g64"))                       # loads the saved tensors
    LLM(quantization={"method": "awq", "path": "smollm2-awq-g64"})             # the same, for awq/gptq
    minillm generate "Hi" --quantization smollm2-awq-g64                       # the CLI takes the folder

This file holds the command-line verbs: `quantize_model` (load, quantize, save) and
`parse_quantization` (what --quantization accepts). The folder's format, how it is written safely
and how it is checked and loaded, is `layers/quantization/saved.py`; `load_quantized`, the config
that loads one, is in `layers/quantization/calibration.py`.

--overwrite replaces only a folder `minillm quantize` wrote (its quant_config.json and tensors,
nothing else): the old folder is deleted whole, so `--out . --overwrite` in a project folder, or a
mistyped --out, would otherwise delete files quantize never wrote (probe round 4, M5).

Models with routed experts are refused up front: their experts are not linear layers the format
saves (LLM(quantization="int8") quantizes them at load time instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .layers.quantization import saved
from .layers.quantization.calibration import load_quantized
from .layers.quantization.saved import METHODS, save_quantized
from .loader import load_model, read_model_config

__all__ = ["check_out", "parse_quantization", "quantize_model"]  # the verbs; the format is saved.py's


def check_out(out: str | Path, model: str | Path | None = None, overwrite: bool = False) -> Path:
    """saved.check_out (never into the model, a file, or a non-empty folder without overwrite), and
    with overwrite a non-empty folder must be one quantize wrote: -> the folder's absolute path."""
    out = saved.check_out(out, model, overwrite)
    if overwrite and out.is_dir() and any(out.iterdir()):
        ours = {saved.CONFIG_FILE, saved.TENSORS_FILE}
        others = sorted(p.name for p in out.iterdir() if p.name not in ours)
        config = out / saved.CONFIG_FILE
        try:
            written = json.loads(config.read_text()).get("format") == saved.FORMAT
        except (OSError, ValueError, AttributeError):
            written = False
        if not written or others:
            why = (f"it holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, which quantize did not "
                   f"write" if others else f"it has no {saved.CONFIG_FILE} of this format")
            raise ValueError(f"--out {out}: --overwrite replaces only a folder written by `minillm quantize`, and "
                             f"{why}; choose a new folder (or empty this one yourself)")
    return out


def quantize_model(source, method: str, options: dict, out: str | Path, *, dtype=torch.float32,
                   device="cpu", overwrite: bool = False) -> Path:
    """Load `source` quantized by `method` (calibrating AWQ/GPTQ on the corpus) and save it to `out`.
    Everything that can be refused (the method, --out, a model with routed experts) is refused before
    the model loads."""
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, not {method!r}")
    check_out(out, source, overwrite)
    config = read_model_config(source)
    if config.moe is not None:
        raise ValueError(f"minillm quantize saves dense models; {config.name or source} has routed experts "
                         f"({config.moe.num_experts} per MoE layer), which this format does not hold. Quantize it at "
                         f"load time instead: LLM(model, quantization='int8') or --quantization int8")
    model, _, _ = load_model(source, dtype=dtype, device=device, quantization={"method": method, **options})
    return save_quantized(model, out, method, options, None if source is None else str(source), overwrite)


def parse_quantization(text: str | None):
    """The CLI's --quantization: none, a method name, NAME:key=value,key=value (e.g. awq:group_size=64,
    int4:lm_head=none), or a folder written by `minillm quantize`, optionally FOLDER:lm_head=none -> what
    LLM(quantization=...) takes."""
    if text is None or text.lower() == "none":
        return None
    if Path(text).is_dir():
        return load_quantized(text)
    name, _, rest = text.rpartition(":") if ":" in text else (text, "", "")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--quantization options are key=value pairs after the name (awq:group_size=64), "
                             f"not {item!r}")
        options[key.strip()] = _value(value.strip())
    if ("/" in name or name.startswith(("~", "."))) and not Path(name).is_dir():
        # a path, not a method name (none has a slash or starts with . or ~): say that it is missing
        raise ValueError(f"--quantization {name}: no such folder (a folder written by `minillm quantize`); "
                         f"or give a method name such as {', '.join(METHODS)} or fp8")
    if Path(name).is_dir():  # a saved folder with load options: FOLDER:lm_head=none
        unknown = sorted(set(options) - {"lm_head"})
        if unknown:
            raise ValueError(f"--quantization {name}: a saved folder takes only the option lm_head, not {unknown[0]!r}")
        return load_quantized(name, **options)
    return {"method": name, **options} if options else name


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
