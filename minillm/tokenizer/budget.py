"""Encoding untrusted text with bounded work: a token budget and a stop hook.

A server refuses a prompt longer than the context, but it only knows a text's token count after
BPE. BPE is cheap per word and costly per byte of one long chunk (a pretoken): GPT-2's pattern makes
400,000 `a`s one chunk, and the heap merge loop (bpe.py) spends ~10 us of Python per byte on it, 4 s
to learn that it is 100,000 tokens. `Tokenizer.encode(text, max_tokens=N)` stops as soon as the text
is known to need more than N tokens, and raises TooManyTokens (a ValueError naming the limit):
between chunks by counting, and before a long chunk by a lower bound that costs far less than BPE.

The bound. BPE's output spells the chunk with tokens of the vocabulary, so it holds at least as
many tokens as the *fewest* vocabulary tokens that spell the chunk. That minimum is a dynamic
program over positions: best[k] = the fewest tokens spelling the first k bytes. It can refuse long
before the end: the tokens of BPE's output that reach past byte k - 1 end somewhere in [k, k + L)
(L: the longest token's bytes), and they spell that prefix, so the output holds at least
min(best[k : k + L]) tokens. For 400,000 `a`s and N = 8192 the program stops after ~33,000 bytes.

`should_stop` (a callable) is the other half: a client that leaves while a text that fits is being
encoded stops the work within a few thousand merges, not at the end of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CHECK_EVERY = 4096  # merges (bpe_heap) or chunks (encode) between two calls of should_stop
# The bound's work, per token of the limit: 400,000 `a`s need ~5 lookups a byte and 4 bytes a token
LOOKUPS_PER_TOKEN = 32


class TooManyTokens(ValueError):
    """The text needs more tokens than max_tokens allows; encoding stopped early."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        super().__init__(f"the text is longer than max_tokens={max_tokens} tokens")


class EncodeStopped(Exception):
    """should_stop() answered True: encoding was abandoned (the text may be fine)."""


def check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise EncodeStopped("encoding stopped: should_stop() returned True")


def spellings(vocab: Sequence[bytes]) -> tuple[dict[bytes, bool], int]:
    """Every prefix of a token's bytes -> is it a token itself; and the longest token's length.
    Built once per tokenizer, on the first long chunk (SmolLM2: ~330k prefixes)."""
    prefixes: dict[bytes, bool] = {}
    for v in vocab:
        for i in range(1, len(v)):
            prefixes.setdefault(v[:i], False)
    for v in vocab:
        if v:
            prefixes[v] = True
    return prefixes, max(map(len, vocab), default=1)


def needs_more_than(data: bytes, limit: int, prefixes: dict[bytes, bool], longest: int,
                    should_stop: Callable[[], bool] | None = None) -> bool:
    """True when no `limit` tokens of the vocabulary spell `data`: then BPE gives more than `limit`.
    Returns as soon as that is certain; False (nothing known) when the fewest tokens fit, or after
    LOOKUPS_PER_TOKEN x limit lookups: a run of long tokens (300,000 spaces, 64 to a token) costs the
    program a lookup per byte per token length, and it would fit anyway."""
    n = len(data)
    if n <= limit:  # every token covers at least a byte
        return False
    if n > limit * longest:  # and at most `longest`
        return True
    best = [n + 1] * (n + longest + 1)  # best[k]: the fewest tokens that spell data[:k]
    best[0] = 0
    lookups, most = 0, LOOKUPS_PER_TOKEN * max(limit, 1)
    for i in range(n):
        if i % longest == 0 and i >= longest:
            # best[: i + 1] is final: BPE's tokens that reach past byte i - longest end in this window
            if min(best[i - longest + 1 : i + 1]) > limit:
                return True
            if lookups > most:
                return False
            if i % CHECK_EVERY < longest:
                check_stop(should_stop)
        b = best[i] + 1
        for j in range(i + 1, min(i + longest, n) + 1):
            lookups += 1
            is_token = prefixes.get(data[i:j])
            if is_token is None:  # no token starts with these bytes: no longer one does either
                break
            if is_token and b < best[j]:
                best[j] = b
    return best[n] > limit

def cannot_fit(tok, data: bytes, room: int, should_stop: Callable[[], bool] | None = None) -> bool:
    """True when BPE on the chunk `data` surely gives `tok` more than `room` ids (needs_more_than)."""
    if len(data) <= max(room, 0):  # a chunk never has more tokens than bytes: the common case
        return False
    if tok.uncovered_bytes:
        if tok.unk_token_id is not None and any(b in tok.uncovered_bytes for b in data):
            return False  # unk tokens stand in for bytes: no bound here, BPE's count decides
        data = data.translate(None, tok.uncovered_bytes)  # dropped, as bytes_to_ids drops them
    if getattr(tok, "_spellings", None) is None:
        tok._spellings = spellings(tok.vocab)
    return needs_more_than(data, room, *tok._spellings, should_stop)
