"""SamplingParams: how one request wants its tokens chosen (vLLM's names and defaults).

Every field is checked when the object is built, and a bad value raises a ValueError (or TypeError)
that names the field and what is allowed, before the request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if self.stop is not None else []
        self.stop_token_ids = list(self.stop_token_ids or [])
        _int("n", self.n, 1)
        _num("temperature", self.temperature, 0.0, None, ">= 0 (0 means greedy)")
        _num("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _int("top_k", self.top_k, -1, what=">= 1, or 0 / -1 for no limit")
        _num("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _num("repetition_penalty", self.repetition_penalty, 0.0, None, "> 0 (1 = off)")
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be > 0 (1 = off), got 0")
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
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        for i, t in enumerate(self.stop_token_ids):
            _int(f"stop_token_ids[{i}]", t, 0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, not {type(getattr(self, name)).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
