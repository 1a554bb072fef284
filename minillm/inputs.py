"""Checking a prompt before it reaches the engine: one place, so LLM and LLMEngine say the same thing."""

from __future__ import annotations

from .sampling import SamplingParams


def prompt_ids(tokenizer, vocab_size: int, prompt, name: str = "prompt") -> tuple[str | None, list[int]]:
    """A str (tokenized) or {"prompt_token_ids": [...]} -> (text or None, token ids)."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        # by distinct type, then min and max: loops in C (a server checks every id of every request)
        types = set(map(type, ids)) if isinstance(ids, list) else {None}
        if bool in types or not all(isinstance(t, type) and issubclass(t, int) for t in types):
            raise TypeError(f"{name}['prompt_token_ids'] must be a list of ints")
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise ValueError(f"{name} has token ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
        text = None
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{name} is text but this model has no tokenizer; pass {{'prompt_token_ids': [...]}}")
        text, ids = prompt, tokenizer.encode(prompt)
    else:
        raise TypeError(f"{name} must be a str or a {{'prompt_token_ids': [...]}} dict, not {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    return text, ids


def check_length(name: str, n: int, params: SamplingParams, max_model_len: int) -> None:
    want = n + (params.max_tokens or 1)
    if n >= max_model_len or want > max_model_len:
        raise ValueError(f"{name} has {n} tokens and asks for up to {params.max_tokens} more, but the model's "
                         f"context is {max_model_len} tokens; shorten the prompt or lower max_tokens")
