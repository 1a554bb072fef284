"""The one point where tokens are forbidden, on every sampling path (the worker's sample_step.py).

A token mask says, per row of logits, which tokens may not be sampled now: EOS and the stop tokens
before min_tokens (chapter 02), and, for a request with structured output (chapter 14), every token
its grammar does not allow here. Masking sets their logits to -inf before any path looks at them, so
greedy argmax, the Sampler, the device sampler and the rejection sampler all pick among the same
tokens; the log-probabilities a request asks for still come from the model's raw logits.

A grammar's mask is a packed bitmask, [R, ceil(V / 32)] int32: bit j of word w allows token 32w + j
(XGrammar's layout, so either backend of chapter 14 fills the same buffer). On a GPU it is applied by
one Triton kernel (kernels/token_bitmask.py: the logits read and written once, no [R, V] temporary,
no host sync), elsewhere by the plain-PyTorch reference.
"""

from __future__ import annotations

import torch

from ..kernels.token_bitmask import apply_token_bitmask_triton
from ..structured_output.bitmask import apply_token_bitmask


def apply_token_masks(logits: torch.Tensor, banned: list[list[int]] | None = None,
                      bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> the same with forbidden tokens at -inf (a new tensor; the input is untouched).
    banned: per row, token ids that may not be sampled (None: none); bitmask: [R, ceil(V / 32)] int32
    of allowed tokens (None: all allowed)."""
    if banned is None and bitmask is None:
        return logits
    raw = logits
    if banned is not None:
        rows = [r for r, ids in enumerate(banned) for _ in ids]
        cols = [t for ids in banned for t in ids]
        if cols:
            logits = logits.index_put((torch.tensor(rows, device=logits.device),
                                       torch.tensor(cols, device=logits.device)),
                                      torch.tensor(float("-inf"), device=logits.device))
    if bitmask is not None:  # a copy, masked in place: the raw logits stay for the logprobs
        apply = apply_token_bitmask_triton if logits.is_cuda else apply_token_bitmask
        logits = apply(logits.clone() if logits is raw else logits, bitmask.to(logits.device))
    return logits
