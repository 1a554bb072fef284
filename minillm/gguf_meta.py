"""Reading GGUF files with the `gguf` package: the header (key/values) and the tensor table.

A GGUF file is a header of typed key/value pairs (architecture, hyper-parameters, the tokenizer's
vocabulary and merges, the chat template), then a table of tensor descriptions, then the tensor
data. Parsing the header of a 49,152-token vocabulary takes seconds in pure Python, so a reader is
kept per file and shared by the tokenizer and the model loader.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path


def open_gguf(path: str | Path):
    """A gguf.GGUFReader for `path` (memory-mapped; cached while the file is unchanged)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    st = os.stat(path)
    return _open(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _open(path: str, size: int, mtime: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError/struct errors on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_gguf_metadata(path: str | Path) -> dict:
    """All key/value fields of a GGUF file as plain Python values (str, int, float, bool, list)."""
    reader = open_gguf(path)
    try:
        return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
