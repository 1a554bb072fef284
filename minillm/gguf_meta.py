"""Reading a GGUF file's metadata (the key/value header) with the `gguf` package.

A GGUF file is a header of typed key/value pairs (architecture, hyper-parameters, the tokenizer's
vocabulary and merges, the chat template), then a table of tensor descriptions, then the tensor data.
The tokenizer needs only the key/values; the model loader reads the tensors too.
"""

from __future__ import annotations

from pathlib import Path


def read_gguf_metadata(path: str | Path) -> dict:
    """All key/value fields of a GGUF file as plain Python values (str, int, float, bool, list)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
        meta = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            meta[key] = field.contents()
        return meta
    except Exception as e:  # the reader raises bare ValueError/IndexError/struct errors on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
