"""Writing a Tokenizer as Hugging Face tokenizer.json, so `tokenizers` can load what we trained.

This is how the tests hold a trained tokenizer to an outside oracle: HF's Rust BPE must cut every
text into the same ids as ours, given our vocab and merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from .byte_level import spell
from .tokenizer import Tokenizer


def to_tokenizer_json(tok: Tokenizer) -> dict:
    by_rank = sorted(tok.merges.items(), key=lambda kv: kv[1][0])
    added_ids = set(tok.added_tokens.values())
    vocab = {spell(v): i for i, v in enumerate(tok.vocab) if i not in added_ids}
    pre = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
           for p in tok.pre_tokenizer.patterns]
    pre.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    norm = tok.pre_tokenizer.normalization
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": i in tok.special_ids}
            for t, i in sorted(tok.added_tokens.items(), key=lambda kv: kv[1])
        ],
        "normalizer": {"type": norm} if norm else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[spell(tok.vocab[a]), spell(tok.vocab[b])] for (a, b), _ in by_rank],
        },
    }


def save_tokenizer_json(tok: Tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_tokenizer_json(tok), ensure_ascii=False), encoding="utf-8")
    return path
