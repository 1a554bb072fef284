"""SamplingParams: how one request wants its tokens chosen (vLLM's names and defaults).

Every field is checked when the object is built, and again by `verify()` (call it after editing a
field): a bad value raises a ValueError (or TypeError) that names the field and what is allowed, before
the request reaches the engine. `verify(vocab_size)` also checks the token ids the params carry
against the model's vocabulary.

The sampler computes in float32, so the numeric rules are float32's (the sampler's own guard is the
last line, `sampler.py`):
  - every number must be finite, also once rounded to float32 (1e39 is inf there);
  - temperature: 0 is greedy, and so is any temperature below GREEDY_TEMPERATURE = 1e-5 (vLLM's rule):
    it is stored as 0.0, because logits / 1e-40 overflows float32 to inf and the softmax to NaN;
  - top_p must be > 0 in float32 (1e-300 rounds to 0, which would filter out every token);
  - repetition_penalty must be at least float32's smallest normal number (1.2e-38), so that a logit
    can be divided by it without the quotient being inf for every positive logit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from ..distributed.kv_transfer.config import check_kv_transfer_params
from ..structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
# A request's stop list is matched in the engine's step and travels with each of its prompts to the
# engine core: bounded, as OpenAI's API bounds it (4 strings), so that its memory and cost stay
# proportional to the request (probe round 4, S1: 100,000 stops x 1024 prompts took 6 GB). vLLM and
# llama.cpp's server take any number and check each string after every token; 64 keeps every list
# seen in practice (chat templates' end markers, few-shot separators) and the automaton small.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192  # all stop strings together
MAX_TOP_K = 1 << 31  # far above any vocabulary; the sampler's int64 tensors must hold it
GREEDY_TEMPERATURE = 1e-5  # temperatures below this (0 included) sample greedily
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: 1 / it is still finite


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    seed: int | None = None  # the same seed gives the same tokens, whatever else is in the batch
    max_tokens: int | None = 16  # None = until the context is full
    min_tokens: int = 0  # EOS and stop tokens are not allowed before this many tokens
    stop: list[str] = field(default_factory=list)  # strings that end the output (not included in it)
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end the output
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # return the log-probabilities of this many top tokens per step
    skip_special_tokens: bool = True
    structured_outputs: Any = None  # StructuredOutputsParams (or its fields as a dict): chapter 14
    # vLLM's extra_args: what a plug-in reads per request; chapter 17's KV connectors read
    # extra_args["kv_transfer_params"] (the disaggregated request's handle, distributed/kv_transfer/config.py)
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        self.verify()

    def verify(self, vocab_size: int | None = None) -> None:
        """Check every field again (after an edit, or before the engine takes the request).

        Normalises as the constructor does: `stop` "x" -> ["x"], None -> [], a tuple -> a list; a
        temperature below GREEDY_TEMPERATURE -> 0.0 (greedy). With `vocab_size`, every token id the
        params carry (stop_token_ids) must also lie in [0, vocab_size).
        """
        self.stop = _str_list("stop", self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        _int("n", self.n, 1)
        _num("temperature", self.temperature, 0.0, None, ">= 0 (0 means greedy)")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # logits / temperature would overflow float32: greedy is the limit
        _num("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        if _float32(self.top_p) == 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}"
                             + (" (0 in float32, the sampler's precision)" if self.top_p else ""))
        _int("top_k", self.top_k, -1, MAX_TOP_K, what=f">= 1 and at most {MAX_TOP_K}, or 0 / -1 for no limit")
        _num("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _num("repetition_penalty", self.repetition_penalty, 0.0, None, "> 0 (1 = off)")
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be > 0 (1 = off), got 0")
        if self.repetition_penalty < FLOAT32_TINY:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off) and at least {FLOAT32_TINY:.4g} (float32's "
                             f"smallest normal number: logits are divided by it), got {self.repetition_penalty}")
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        if self.seed is not None:
            _int("seed", self.seed, 0, what="a non-negative int or None")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, what=">= 1, or None for the rest of the context")
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise TypeError(f"stop[{i}] must be a non-empty string, not {type(s).__name__} ({s!r})")
            if not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        if (chars := sum(map(len, self.stop))) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings hold {chars} characters in all; at most {MAX_STOP_CHARS} are allowed")
        for i, t in enumerate(self.stop_token_ids):
            _int(f"stop_token_ids[{i}]", t, 0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if isinstance(self.structured_outputs, dict):  # vLLM's extra body field, as JSON gives it
            fields = self.structured_outputs
            unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {unknown}; allowed: json, regex, "
                                 "choice, grammar, json_object")
            self.structured_outputs = StructuredOutputsParams(**fields)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict, not "
                                f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise ValueError("structured_outputs cannot be combined with ignore_eos: a finished grammar "
                                 "allows only EOS")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise TypeError(f"extra_args must be a dict or None, not {type(self.extra_args).__name__}")
            check_kv_transfer_params(self.extra_args.get("kv_transfer_params"))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, not {type(getattr(self, name)).__name__}")
        if vocab_size is not None:
            _int("vocab_size", vocab_size, 1)
            for i, t in enumerate(self.stop_token_ids):
                if t >= vocab_size:
                    raise ValueError(f"stop_token_ids[{i}] must be a token id in [0, {vocab_size}) (the model's "
                                     f"vocabulary), got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _str_list(name, value) -> list:
    """None, one string, or a list (tuple, any iterable) of them -> a new list; items checked later."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a string or a list of strings, not {type(value).__name__} ({value!r})")
    return list(value)


def _int_list(name, value) -> list:
    """None or a list (tuple, set, range, any iterable) of ints -> a new list; items checked later."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids (ints), not {type(value).__name__} ({value!r})")
    return list(value)


def _float32(x: float) -> float:
    """x rounded to float32, the sampler's precision (inf where it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _int(name, value, lo=None, hi=None, what=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        allowed = what or (f">= {lo}" if hi is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _num(name, value, lo, hi, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} ({value!r})")
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):  # NaN too
        raise ValueError(f"{name} must be {what}, got {value}")
    if not math.isfinite(_float32(value)):
        raise ValueError(f"{name} must be {what} and finite in float32 (at most {FLOAT32_MAX:.4g}), got {value}")
