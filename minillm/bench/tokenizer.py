"""Benchmark: encode throughput of minillm's tokenizer vs HF `tokenizers`, single thread (chapter 01)."""

from __future__ import annotations

import os
import time

from ..tokenizer import load_tokenizer
from .table import print_table


def make_corpus(n_chars: int) -> list[str]:
    """Real text that every Python install has: the standard library's source files, code and English
    docstrings, in a fixed order, until n_chars. Each file is one document."""
    import sysconfig
    from pathlib import Path

    docs, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        size += len(text)
        if size >= n_chars:
            break
    return docs


def _best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(n_chars: int = 2_000_000, reps: int = 3, docs: list[str] | None = None) -> list[dict]:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # HF's Rust side: one thread, like ours
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    docs = docs if docs is not None else make_corpus(n_chars)
    ours = load_tokenizer()
    rows = []

    def encode_all():
        return [ours.encode(d) for d in docs]

    def cold():  # the word cache emptied first: every new chunk goes through the BPE merge loop
        ours._cache.clear()
        return encode_all()

    ids = encode_all()
    n_tokens = sum(map(len, ids))
    mb = sum(len(d.encode()) for d in docs) / 1e6
    for label, fn in [("minillm (cold cache)", cold), ("minillm (warm cache)", encode_all)]:
        s = _best_of(fn, reps)
        rows.append({"tokenizer": label, "seconds": s, "MB_per_s": mb / s, "tokens_per_s": n_tokens / s})
    try:
        from transformers import AutoTokenizer

        from ..model_files import embedded_model_path

        path = embedded_model_path()
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer
        if [hf.encode(d, add_special_tokens=False).ids for d in docs] != ids:
            raise AssertionError("minillm and HF tokenizers disagree on the benchmark text")
        s = _best_of(lambda: [hf.encode(d, add_special_tokens=False) for d in docs], reps)
        rows.append({"tokenizer": "HF tokenizers (Rust)", "seconds": s, "MB_per_s": mb / s, "tokens_per_s": n_tokens / s})
        for r in rows:
            r["vs_HF"] = rows[-1]["seconds"] / r["seconds"]
    except ImportError:
        print("transformers is not installed: no HF peer in this run")
    print_table(rows, title=f"encode {len(docs)} documents, {mb:.2f} MB -> {n_tokens:,} tokens "
                f"(single thread, best of {reps})")
    return rows
