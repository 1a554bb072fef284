"""Training a byte-level BPE: learn the merges from a text.

Start with 256 tokens, one per byte. Count every adjacent pair of tokens inside every pre-tokenized
chunk (never across chunks), make the most frequent pair a new token, replace it everywhere, and
repeat until the vocabulary has the size asked for. The merges, in the order they were made, are the
tokenizer: encoding (bpe.py) replays them.

Chunks repeat a lot (" the", " of"), so we count each distinct chunk once and weight it by how often
it occurs: a text of a million words is a few tens of thousands of distinct chunks.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from tqdm.auto import tqdm

from .bpe import Merges, merge_pair
from .pretokenize import GPT2, PreTokenizer
from .tokenizer import Tokenizer


def count_pairs(words: dict[tuple[int, ...], int]) -> Counter:
    """How often each adjacent pair of ids occurs, over all chunks weighted by their frequency."""
    counts: Counter = Counter()
    for ids, freq in words.items():
        for pair in pairwise(ids):
            counts[pair] += freq
    return counts


def train_bpe(
    text: str,
    vocab_size: int,
    special_tokens: list[str] = (),
    pattern: str = GPT2,
    progress: bool = False,
) -> Tokenizer:
    """Learn vocab_size - 256 - len(special_tokens) merges from `text`.

    Ties between equally frequent pairs go to the pair first seen in the text, so a run is
    reproducible. Training stops early when no pair occurs twice (the text is exhausted).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    if isinstance(special_tokens, str):
        raise TypeError("special_tokens must be a list of strings, not one string")
    special_tokens = list(special_tokens)
    if len(set(special_tokens)) != len(special_tokens) or not all(isinstance(t, str) and t for t in special_tokens):
        raise ValueError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be at least 256 + {len(special_tokens)} special tokens, not {vocab_size}")
    pre = PreTokenizer((pattern,))
    words: dict[tuple[int, ...], int] = Counter(tuple(c.encode("utf-8")) for c in pre.split(text))

    vocab = [bytes([b]) for b in range(256)]
    index = {v: i for i, v in enumerate(vocab)}
    merges: Merges = {}
    steps = vocab_size - 256 - len(special_tokens)
    for rank in tqdm(range(steps), desc="BPE merges", disable=not progress):
        counts = count_pairs(words)
        if not counts:
            break
        pair, freq = max(counts.items(), key=lambda kv: kv[1])  # first-seen wins a tie: max is stable
        if freq < 2:
            break
        joined = vocab[pair[0]] + vocab[pair[1]]
        if joined not in index:  # ("ab","c") and ("a","bc") make the same token: keep one id for it
            index[joined] = len(vocab)
            vocab.append(joined)
        new_id = index[joined]
        merges[pair] = (rank, new_id)
        merged: Counter = Counter()
        for ids, f in words.items():
            merged[tuple(merge_pair(list(ids), pair, new_id)) if pair[0] in ids else ids] += f
        words = merged

    added = {}
    for tok in special_tokens:
        added[tok] = len(vocab)
        vocab.append(tok.encode("utf-8"))
    return Tokenizer(
        vocab=vocab,
        merges=merges,
        pre_tokenizer=pre,
        added_tokens=added,
        special_ids=added.values(),
        eos_token_id=added.get(special_tokens[0]) if special_tokens else None,
        name=f"trained-bpe-{len(vocab)}",
    )
