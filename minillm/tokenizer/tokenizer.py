"""The byte-level BPE tokenizer: text <-> token ids.

encode:  text --(split out added tokens)--> plain stretches and added tokens
              --(pre-tokenize)--> chunks --(UTF-8, one id per byte)--> byte ids --(BPE)--> token ids
decode:  ids --> the bytes each token stands for --> UTF-8 text (bad byte runs become U+FFFD)

Added tokens ("<|im_start|>", "<|endoftext|>") are matched in the raw text first and never go
through BPE. `allowed_special` decides which of them a text may produce; pass "none" to encode
untrusted text so that a user typing "<|im_end|>" cannot forge the end of a chat turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from operator import index as as_int

import regex

from .bpe import Merges, bpe
from .budget import CHECK_EVERY, TooManyTokens, cannot_fit, check_stop
from .byte_level import spell
from .pretokenize import PreTokenizer

_CACHE_LIMIT = 200_000  # chunks; a long run sees the same words over and over
_CACHE_MAX_CHUNK = 256  # characters


class Tokenizer:
    """Byte-level BPE with added tokens, BOS/EOS rules and a chat template.

    vocab[i] is the bytes token i stands for. merges maps a pair of ids to (rank, merged id).
    added_tokens maps the text of each added token to its id; those in `special_ids` are special
    (dropped by decode(skip_special_tokens=True)).
    """

    def __init__(
        self,
        *,
        vocab: Sequence[bytes],
        merges: Merges,
        pre_tokenizer: PreTokenizer,
        added_tokens: dict[str, int] | None = None,
        special_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        unk_token_id: int | None = None,
        fuse_unk: bool = False,
        name: str = "",
    ):
        self.vocab = list(vocab)
        self.merges = merges
        self.pre_tokenizer = pre_tokenizer
        self.added_tokens = dict(added_tokens or {})
        self.special_ids = frozenset(special_ids)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.unk_token_id = unk_token_id
        self.fuse_unk = fuse_unk
        self.name = name
        self._check_ids()
        # The id of the one-byte token for every byte value: where BPE starts from. A vocabulary may
        # lack some bytes: SmolLM2 has no token for six control characters, nor for bytes that never
        # occur in UTF-8 or only in unassigned planes. Like llama.cpp (and current HF) we drop such
        # bytes, so their neighbours merge as if adjacent; a tokenizer.json that names an unk token
        # gets that token instead, as HF's BPE does. `uncovered_bytes` lists them.
        single = {v: i for i, v in enumerate(self.vocab) if len(v) == 1 and i not in self.special_ids}
        self.byte_to_id: list[int | None] = [single.get(bytes([b])) for b in range(256)]
        self.uncovered_bytes = bytes(b for b in range(256) if self.byte_to_id[b] is None)
        if len(self.uncovered_bytes) > 64:
            raise ValueError(
                f"vocab has no token for {len(self.uncovered_bytes)} of the 256 bytes: not a byte-level BPE vocabulary"
            )
        self._cache: dict[str, list[int]] = {}

    def _check_ids(self) -> None:
        n = len(self.vocab)
        for what, i in [("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)]:
            if i is not None and not 0 <= i < n:
                raise ValueError(f"{what}={i} is outside the vocabulary (0..{n - 1})")
        for text, i in self.added_tokens.items():
            if not 0 <= i < n:
                raise ValueError(f"added token {text!r} has id {i}, outside the vocabulary (0..{n - 1})")

    # ---- the public surface ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The added tokens that are special (control) tokens, text -> id."""
        return {t: i for t, i in self.added_tokens.items() if i in self.special_ids}

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True, allowed_special="all", *,
               max_tokens: int | None = None, should_stop=None) -> list[int]:
        """text -> token ids.

        add_special_tokens: add the BOS/EOS the model's files ask for (SmolLM2 asks for none).
        allowed_special: which added tokens the text may contain: "all", "none", or a set of them.
        max_tokens: raise TooManyTokens (a ValueError) as soon as the ids would be more than this,
        after work proportional to about max_tokens tokens, not to the text (budget.py).
        should_stop: a callable checked every few thousand chunks or merges; when it returns True,
        encoding ends with EncodeStopped (a server's client left).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be None or an int >= 0, not {max_tokens!r}")
        _check_unicode(text)
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        splitter = self._added_splitter(_as_allowed(allowed_special, self.added_tokens))
        last = 0
        if splitter is not None:
            for m in splitter.finditer(text):
                self._encode_plain(text[last : m.start()], ids, max_tokens, should_stop)
                ids.append(self.added_tokens[m.group()])
                last = m.end()
        self._encode_plain(text[last:], ids, max_tokens, should_stop)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        if max_tokens is not None and len(ids) > max_tokens:  # an added token or EOS went past it
            raise TooManyTokens(max_tokens)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """token ids -> text. Byte runs that are not valid UTF-8 become U+FFFD, as in HF."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """token ids -> the raw bytes they stand for (may end inside a UTF-8 character)."""
        ids = self._check_token_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join(self.vocab[i] for i in ids)

    def bytes_to_ids(self, data: bytes) -> list[int]:
        """One id per byte, where BPE starts from. A byte with no token is dropped, or becomes the
        unk token when the tokenizer has one (consecutive ones fused into one if fuse_unk)."""
        table = self.byte_to_id
        ids = [table[b] for b in data]
        if None not in ids:
            return ids
        out: list[int] = []
        for i in ids:
            if i is None:
                if self.unk_token_id is None or (self.fuse_unk and out and out[-1] == self.unk_token_id):
                    continue
                i = self.unk_token_id
            out.append(i)
        return out

    def covers(self, text: str) -> bool:
        """True when every byte of `text` has a token, so that decode(encode(text)) == text."""
        return not self.uncovered_bytes or not set(text.encode("utf-8")) & set(self.uncovered_bytes)

    def id_to_token(self, token_id: int) -> str:
        """The token as its vocab entry spells it ('Ġworld'), or an added token's own text."""
        (token_id,) = self._check_token_ids([token_id])
        for text, i in self.added_tokens.items():
            if i == token_id:
                return text
        return spell(self.vocab[token_id])

    def token_to_id(self, token: str) -> int:
        """Inverse of id_to_token; raises ValueError for a string that is no single token."""
        if token in self.added_tokens:
            return self.added_tokens[token]
        index = self._spelled_index()
        if token not in index:
            raise ValueError(f"{token!r} is not a token of this vocabulary")
        return index[token]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, *,
                            max_tokens: int | None = None, **kwargs):
        """Render a conversation with the model's own template: a str, or its ids if tokenize=True.

        With tokenize=True a message's content is the user's text: where it spells a control token
        ("<|im_end|>") it gets the ids of those characters, never the control token, so no message can
        end its turn early or forge another role's turn; the template's own markers are control
        tokens. Encoding the returned str yourself cannot tell the two apart: use tokenize=True.
        max_tokens (with tokenize=True): TooManyTokens once the ids would be more, as in encode().
        """
        from .chat_template import chat_parts, render_chat

        if not tokenize:
            return render_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        _, parts = chat_parts(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self._encode_parts(parts, max_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name or 'unnamed'}: vocab={self.vocab_size}, merges={len(self.merges)}, "
            f"added={len(self.added_tokens)}, {self.pre_tokenizer})"
        )

    # ---- the machinery --------------------------------------------------------------------------

    def _encode_plain(self, text: str, ids: list[int] | None = None, max_tokens: int | None = None,
                      should_stop=None) -> list[int]:
        """Text with no added tokens in it -> ids (appended to `ids`), chunk by chunk, through a cache.
        With max_tokens, TooManyTokens once `ids` would hold more, and a long chunk is first checked
        against the fewest tokens that could spell it (budget.py), so it is refused without its BPE."""
        ids = [] if ids is None else ids
        budgeted = max_tokens is not None or should_stop is not None
        # unbudgeted (trusted text, the common case): the chunks as one list, the loop as lean as it goes
        chunks = self.pre_tokenizer.iter_split(text) if budgeted else self.pre_tokenizer.split(text)
        cache = self._cache
        for n, chunk in enumerate(chunks):
            hit = cache.get(chunk)
            if hit is None:
                data = chunk.encode("utf-8")
                if max_tokens is not None and cannot_fit(self, data, max_tokens - len(ids), should_stop):
                    raise TooManyTokens(max_tokens)
                hit = bpe(self.bytes_to_ids(data), self.merges, should_stop)
                if len(chunk) <= _CACHE_MAX_CHUNK:  # a long run is unlikely to come back: do not cache it
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[chunk] = hit
            ids += hit
            if budgeted:
                if max_tokens is not None and len(ids) > max_tokens:
                    raise TooManyTokens(max_tokens)
                if n % CHECK_EVERY == CHECK_EVERY - 1:
                    check_stop(should_stop)
        return ids

    def _encode_parts(self, parts: list[tuple[str, bool]], max_tokens: int | None = None) -> list[int]:
        """[(text, trusted)] -> the ids of their concatenation, as encode(add_special_tokens=False)
        gives them, except that control tokens are matched only in trusted parts: an untrusted part's
        control-token text is plain text (its other added tokens stay added tokens, as in HF). Plain
        text runs on across parts, so BPE sees the same stretches encode() would."""
        trusted = self._added_splitter(frozenset(self.added_tokens))
        untrusted = self._added_splitter(frozenset(t for t, i in self.added_tokens.items() if i not in self.special_ids))
        ids: list[int] = []
        plain: list[str] = []  # text since the last added token
        for text, is_trusted in parts:
            _check_unicode(text)
            splitter, last = (trusted if is_trusted else untrusted), 0
            for m in splitter.finditer(text) if splitter is not None else ():
                plain.append(text[last : m.start()])
                self._encode_plain("".join(plain), ids, max_tokens)
                ids.append(self.added_tokens[m.group()])
                plain, last = [], m.end()
            plain.append(text[last:])
        ids = self._encode_plain("".join(plain), ids, max_tokens)
        if max_tokens is not None and len(ids) > max_tokens:  # the last added token went past it
            raise TooManyTokens(max_tokens)
        return ids

    @lru_cache(maxsize=16)  # noqa: B019 -- a handful of allowed sets per tokenizer, kept for its life
    def _added_splitter(self, allowed: frozenset[str]) -> regex.Pattern | None:
        if not allowed:
            return None
        # longest first, so "<|im_start|>" wins over a shorter token that is its prefix
        alternatives = sorted(allowed, key=len, reverse=True)
        return regex.compile("|".join(regex.escape(t) for t in alternatives))

    def _spelled_index(self) -> dict[str, int]:
        if not hasattr(self, "_index"):
            self._index = {spell(v): i for i, v in enumerate(self.vocab)}
        return self._index

    def _check_token_ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes, int)) or ids is None or not hasattr(ids, "__iter__"):
            raise TypeError(f"token ids must be a sequence of ints, not {type(ids).__name__}")
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        out = []
        n = len(self.vocab)
        for pos, i in enumerate(ids):
            try:
                if isinstance(i, bool):
                    raise TypeError
                i = as_int(i)
            except TypeError:
                raise TypeError(f"token id at position {pos} is a {type(i).__name__}, not an int") from None
            if not 0 <= i < n:
                raise ValueError(f"token id {i} at position {pos} is outside the vocabulary (0..{n - 1})")
            out.append(i)
        return out


def _as_allowed(allowed_special, added_tokens: dict[str, int]) -> frozenset[str]:
    if allowed_special == "all":
        return frozenset(added_tokens)
    if allowed_special in ("none", None):
        return frozenset()
    if isinstance(allowed_special, str) or not hasattr(allowed_special, "__iter__"):
        raise ValueError(f"allowed_special must be 'all', 'none' or a set of added tokens, not {allowed_special!r}")
    allowed = frozenset(allowed_special)
    unknown = sorted(allowed - added_tokens.keys())
    if unknown:
        known = ", ".join(sorted(added_tokens)[:6])
        raise ValueError(f"unknown special token(s) {unknown} in allowed_special; this tokenizer has: {known}, ...")
    return allowed


def _check_unicode(text: str) -> None:
    """A str can hold lone surrogates (from a bad decode); they have no UTF-8 bytes to tokenize."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"text is not valid Unicode: lone surrogate {text[e.start]!r} at index {e.start}"
        ) from None
