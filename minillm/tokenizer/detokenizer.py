"""Incremental detokenization: streaming text out one token at a time.

A byte-level token is a run of bytes, not of characters: '😀' is four bytes (F0 9F 98 80) and a model
may emit it as two or three tokens. Decoding each token on its own would print U+FFFD garbage
mid-stream. So the detokenizer keeps the bytes that end inside a character and emits text only up
to the last complete UTF-8 character; the rest waits for the next token.

A UTF-8 character starts with a lead byte that says how long it is, followed by continuation bytes:

    0xxxxxxx               1 byte  (ASCII)
    110xxxxx 10xxxxxx      2 bytes
    1110xxxx 10xxxxxx x2   3 bytes
    11110xxx 10xxxxxx x3   4 bytes

Invariant (tested): the pieces it emits, joined, equal tokenizer.decode(all ids), whatever the ids.
"""

from __future__ import annotations


def utf8_length(lead: int) -> int:
    """How many bytes a character starting with `lead` has; 0 for a continuation byte (10xxxxxx)."""
    if lead < 0x80:
        return 1
    if lead < 0xC0:
        return 0
    if lead < 0xE0:
        return 2
    if lead < 0xF0:
        return 3
    return 4


def complete_prefix(data: bytes) -> int:
    """The length of the longest prefix of `data` that does not end inside a UTF-8 character.

    Only the last three bytes can belong to an unfinished character, so look back at most three
    bytes for a lead byte; if the character it starts needs more bytes than are there, cut before it.
    Stray continuation bytes are let through (decode turns them into U+FFFD either way). Bytes that
    are never valid leads (0xC0, 0xC1, 0xF5-0xFF) are treated as leads and may wait a step or two:
    that delays their U+FFFD, never changes it.
    """
    n = len(data)
    for back in range(1, min(3, n) + 1):
        need = utf8_length(data[n - back])
        if need == 0:
            continue  # a continuation byte: keep looking for its lead
        return n - back if need > back else n
    return n


def known_ids(tokenizer) -> int | None:
    """How many ids the tokenizer has text for (None: a tokenizer that does not say). A model's
    embedding may have more rows (vocabularies padded to a multiple of 64 or 128, e.g. Qwen2.5's
    151,936 for 151,665 tokens); a sampled id past them adds no text, as HF tokenizers' decode skips
    ids it has no token for."""
    return len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else None


class IncrementalDetokenizer:
    """Feed token ids one at a time with step(); each call returns the text that is now final."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.num_known = known_ids(tokenizer)  # ids past it (a padded embedding) add no text
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._pending = b""  # bytes of an unfinished character

    def step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self.num_known is not None and token_id >= self.num_known:
            return ""
        data = self._pending + self.tokenizer.decode_bytes([token_id], self.skip_special_tokens)
        cut = complete_prefix(data)
        self._pending = data[cut:]
        piece = data[:cut].decode("utf-8", errors="replace")
        self.text += piece
        return piece

    def flush(self) -> str:
        """End of stream: whatever is left (an unfinished character becomes U+FFFD, as in decode)."""
        piece = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        self.text += piece
        return piece
