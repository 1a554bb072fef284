"""Checks for lab 01: the BPE merge step and the encoder, against minillm's tokenizer."""

from __future__ import annotations

import random
from collections import Counter
from functools import cache
from types import MappingProxyType

from ..tokenizer import bpe, count_pairs, load_tokenizer, merge_pair
from .checker import check
from .hints import Hints


@cache
def _tok():
    return load_tokenizer()


def check_count_pairs(fn, cases: int = 200):
    """fn(words: dict[tuple[int, ...], int]) -> Counter of adjacent pairs weighted by frequency."""

    def case(rng: random.Random):
        words = {tuple(rng.randrange(6) for _ in range(rng.randint(1, 8))): rng.randint(1, 9) for _ in range(20)}
        return (words,)

    return check("count_pairs", fn, count_pairs, case, cases=cases, equal=lambda a, b: Counter(a) == b)


def check_merge_pair(fn, cases: int = 300):
    """fn(ids, pair, new_id) -> ids with every non-overlapping occurrence of pair replaced, left to right."""

    def case(rng: random.Random):
        ids = [rng.randrange(4) for _ in range(rng.randint(0, 16))]
        return ids, (rng.randrange(4), rng.randrange(4)), 99

    return check("merge_pair", fn, lambda ids, p, n: merge_pair(list(ids), p, n), case, cases=cases)


_WORDS = ["hello", " world", " tokenization", " naïve", " 東京", " 😀", "ing", " the", " Transformer",
          " inference", "123", " unbelievable", " café", " ñandú", "!!!", " LLM", " résumé", "\n\n", "    "]
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéüñ東京😀"


def _random_chunk(rng: random.Random) -> str:
    """A known word, a made-up one (BPE must cope with words it never saw), or a slice of real text
    (contractions, numbers after a space, punctuation runs, whitespace, many scripts)."""
    from ..tokenizer.samples import CODE, COMBINING, EMOJI, NUMBERS, PROSE, SCRIPTS, WHITESPACE

    roll = rng.random()
    if roll < 0.3:
        text = rng.choice(PROSE + CODE + NUMBERS + WHITESPACE + EMOJI + SCRIPTS + COMBINING)
        start = rng.randrange(len(text))
        return text[start : start + rng.randint(1, 40)]
    if roll < 0.6:
        return rng.choice(_WORDS)
    return rng.choice(["", " "]) + "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 12)))


def check_bpe(fn, cases: int = 200):
    """fn(byte_ids, merges) -> the ids after applying the merges, lowest rank first.

    byte_ids are SmolLM2's one-byte tokens for a chunk; merges is SmolLM2's real merge table."""
    tok = _tok()

    def case(rng: random.Random):
        chunk = _random_chunk(rng)
        return tok.bytes_to_ids(chunk.encode("utf-8")), merges

    merges = MappingProxyType(tok.merges)  # read-only: a student's function cannot change the real table
    return check("bpe", fn, lambda ids, merges: bpe(list(ids), merges), case, cases=cases)


def check_encode(fn, cases: int = 100):
    """fn(text) -> SmolLM2's token ids for text (no added tokens in it)."""
    tok = _tok()

    def case(rng: random.Random):
        return ("".join(_random_chunk(rng) for _ in range(rng.randint(1, 8))),)

    return check("encode", fn, lambda text: tok.encode(text), case, cases=cases)


hint = Hints("01", {
    "count_pairs": (
        'A word that occurs 5 times contributes each of its adjacent pairs 5 times.',
        "zip(ids, ids[1:]) gives the adjacent pairs of one word; add the word's frequency to each in a Counter.",
        'for ids, freq in words.items():\n    for pair in zip(ids, ids[1:]):\n        counts[pair] += freq',
    ),
    "merge_pair": (
        'Scan left to right with an index you advance yourself.',
        'When ids[i], ids[i+1] is the pair, emit new_id and skip two; otherwise emit ids[i] and step one. That makes overlapping occurrences (a a a) merge from the left.',
        'while i < len(ids):\n    if i + 1 < len(ids) and (ids[i], ids[i+1]) == pair: out.append(new_id); i += 2\n    else: out.append(ids[i]); i += 1',
    ),
    "bpe": (
        'Merges are applied by rank, not by position: the lowest-ranked pair present anywhere goes first.',
        'Repeat: among the adjacent pairs that are in merges, take the one with the smallest rank (merges[pair][0]) and merge all its occurrences with merge_pair; stop when no pair is in merges.',
        'while len(ids) >= 2:\n    ranked = [(merges[p][0], p) for p in zip(ids, ids[1:]) if p in merges]\n    if not ranked: break\n    _, pair = min(ranked)\n    ids = merge_pair(ids, pair, merges[pair][1])',
    ),
    "encode": (
        'Merges never cross a pre-tokenizer chunk boundary.',
        "Split the text with the tokenizer's pre-tokenizer, turn each chunk's UTF-8 bytes into byte-token ids, run bpe on each chunk with the real merge table, and concatenate.",
        "for chunk in tok.pre_tokenizer.split(text):\n    ids += bpe(tok.bytes_to_ids(chunk.encode('utf-8')), tok.merges)",
    ),
})
