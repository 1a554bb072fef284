"""Pre-tokenization: cut text into chunks that BPE merges never cross.

Merges are learned inside chunks only, so a token never spans a word and the space before the next
one, or a letter and a digit. The cut is a regular expression whose matches (and whatever lies
between them) become the chunks. Each model family has its own pattern; the file's metadata (GGUF
`tokenizer.ggml.pre`, or `pre_tokenizer` in tokenizer.json) says which.

The patterns use Unicode classes (`\\p{L}` letters, `\\p{N}` numbers), which Python's `re` lacks,
hence the `regex` package.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator

import regex

# GPT-2 (2019): contractions, optionally-space-prefixed runs of letters / numbers / other symbols, and
# whitespace. `\s+(?!\S)` leaves the last space of a run to prefix the next word (" " + "world").
GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Llama 3 (tiktoken's cl100k): case-insensitive contractions, numbers in groups of at most three
# digits, and a newline run kept apart from other whitespace.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2 / Qwen3: Llama 3's pattern, but every digit is its own chunk.
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DIGITS_EACH = r"\p{N}"  # HF's Digits(individual_digits=True)
DIGITS_RUN = r"\p{N}+"  # HF's Digits(individual_digits=False)

# GGUF `tokenizer.ggml.pre` -> the split patterns, in order. "smollm" and "gpt2" both cut like GPT-2:
# that is what transformers builds for these files too, and their vocabularies hold single digits only.
GGUF_PRESETS: dict[str, tuple[str, ...]] = {
    "default": (GPT2,),
    "gpt2": (GPT2,),
    "smollm": (GPT2,),
    "llama3": (LLAMA3,),
    "llama-bpe": (LLAMA3,),
    "llama-v3": (LLAMA3,),
    "smaug-bpe": (LLAMA3,),
    "qwen2": (QWEN2,),
    "deepseek-r1-qwen": (QWEN2,),
}


class PreTokenizer:
    """Splits text with a sequence of patterns; each stage cuts every chunk of the stage before.

    A stage keeps both the matches and the stretches between them (HF's `behavior="isolated"`), so
    no character is ever dropped: "".join(split(text)) == normalize(text).
    """

    def __init__(self, patterns: tuple[str, ...] | list[str], normalization: str | None = None):
        if normalization not in (None, "NFC", "NFKC", "NFD", "NFKD"):
            raise ValueError(f"normalization must be None, 'NFC', 'NFKC', 'NFD' or 'NFKD', not {normalization!r}")
        self.patterns = tuple(patterns)
        self.normalization = normalization
        self._compiled = [regex.compile(p) for p in self.patterns]

    def split(self, text: str) -> list[str]:
        return list(self.iter_split(text))

    def iter_split(self, text: str) -> Iterator[str]:
        """split(), one chunk at a time: an encoder that stops early (a token budget) has not paid
        for cutting the rest of a long text."""
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        chunks: Iterable[str] = [text] if text else []
        for pattern in self._compiled:
            chunks = _split_each(pattern, chunks)  # a function, so each stage keeps its own pattern
        return iter(chunks)

    def __repr__(self) -> str:
        return f"PreTokenizer(patterns={len(self.patterns)}, normalization={self.normalization!r})"


def _split_each(pattern: regex.Pattern, chunks: Iterable[str]) -> Iterator[str]:
    for chunk in chunks:
        yield from _isolated_split(pattern, chunk)


def _isolated_split(pattern: regex.Pattern, text: str) -> Iterator[str]:
    """Every match of `pattern`, plus the unmatched text between matches, in order."""
    last = 0
    for m in pattern.finditer(text):
        if m.start() > last:
            yield text[last : m.start()]
        if m.end() > m.start():
            yield m.group()
        last = m.end()
    if last < len(text):
        yield text[last:]
