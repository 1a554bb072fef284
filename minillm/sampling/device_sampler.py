"""Sampling that never waits for the GPU (chapter 13).

The Sampler (sampler.py) asks the GPU questions as it goes: is every row greedy, is any row broken, is
any top-k set. Each answer is a `bool(tensor)`, and each one stops the host until the GPU has finished
everything queued before it, so the host cannot prepare the next step while this one runs. Overlap
scheduling needs a sampler that only *queues* work:

  * what kind of sampling a batch needs (all greedy? any top-k or top-p? any min-p?) is decided on the
    host, from the requests' SamplingParams, which the host has anyway;
  * the guard against broken rows (a NaN, nothing above -inf: `Sampler._fallback_tokens`) is computed
    for every row, and chosen per row with `torch.where` instead of an `if`;
  * the tokens stay on the device (the next step reads them there) and one non-blocking copy sends
    them to pinned host memory, with an event the host waits on only when it needs the values.

It serves the requests whose next token depends on nothing the host alone knows: no logprobs, no
penalties, no banned tokens (min_tokens reached). For them it draws exactly what the Sampler draws:
the same argmax, the same exponential race on the same counter-based uniforms (seeded requests keep
their tokens whatever the batch, and whether the step overlapped or not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rng import uniforms
from .sampler import SamplingMetadata, filtered_probs
from .sampling_params import SamplingParams


def device_samplable(params: SamplingParams, num_output: int) -> bool:
    """Whether a sequence with num_output tokens (pending ones included) samples here."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and num_output >= params.min_tokens)


@dataclass
class SampledTokens:
    """One step's tokens, on their way to the host."""

    next_input: torch.Tensor  # [R] int64 on the device: what the next step feeds (0 for a broken row)
    host: torch.Tensor  # [R] int64, pinned: the tokens, -1 for a row with no token to give
    ready: torch.cuda.Event | None  # recorded after the copy (None on a CPU: the copy was synchronous)

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for this step's copy only, not for the work queued after it
        return self.host.tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                     steps: list[int], host_buffer: torch.Tensor | None = None) -> SampledTokens:
    """logits [R, V] fp32 -> SampledTokens; steps: each row's output position (its RNG counter).
    host_buffer: pinned int64 memory of at least R entries to receive the tokens (the caller's, reused
    once the tokens it held were read; default: a new one)."""
    R, V = logits.shape
    if all(p.temperature == 0 for p in params):  # the common batch: three kernels, not ten
        # a NaN read as -inf: a row without NaN keeps its argmax (the first +inf, if any), a broken row
        # gets the Sampler's fallback (which also reads +inf as float32's largest number: the two differ
        # only for a row holding a NaN, that largest finite number and, after it, +inf)
        scores = logits.nan_to_num(nan=float("-inf"), posinf=float("inf"))  # [R, V]
        best, tokens = scores.max(dim=-1)  # [R], [R]
        empty = best == float("-inf")  # nothing but NaN and -inf: no token to give
        return _to_host(torch.where(empty, 0, tokens), torch.where(empty, -1, tokens), host_buffer)
    best, tokens = logits.max(dim=-1)  # [R], [R]; a NaN row's max is NaN
    meta = SamplingMetadata.build(params, [], [], seeds, [[]] * R, V, logits.device, steps=steps)
    filters = (any((p.top_k > 0 and p.top_k < V) or p.top_p < 1 for p in params), any(p.min_p > 0 for p in params))
    probs = filtered_probs(logits, meta, filters)  # [R, V]
    race = probs / -torch.log(uniforms(meta.seeds, meta.steps, V))  # p_i / E_i
    random_rows = meta.temperature > 0  # [R]
    tokens = torch.where(random_rows, race.argmax(dim=-1), tokens)
    # an overflow to inf or NaN in the filtered distribution makes a random row broken too
    broken_random = random_rows & (probs.isnan().any(dim=-1) | ~(probs.sum(dim=-1) > 0))
    broken = ~(best > float("-inf")) | broken_random  # [R]: NaN or nothing above -inf
    # the Sampler's fallback for broken rows, computed for all: argmax of the finite scores (+inf largest)
    scores = logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)  # [R, V]
    fallback_best, fallback = scores.max(dim=-1)  # [R], [R]
    tokens = torch.where(broken, fallback, tokens)
    empty = fallback_best == float("-inf")  # no finite score at all: no token to give
    # [R]: a valid id to feed (the row's request fails anyway), and what the host reads
    return _to_host(torch.where(empty, 0, tokens), torch.where(empty, -1, tokens), host_buffer)


def _to_host(next_input: torch.Tensor, shown: torch.Tensor, host_buffer: torch.Tensor | None) -> SampledTokens:
    """Start the copy of the tokens to pinned host memory; the event marks its end."""
    R = shown.shape[0]
    if shown.device.type != "cuda":
        return SampledTokens(next_input, shown, None)
    host = host_buffer[:R] if host_buffer is not None else torch.empty(R, dtype=torch.int64, pin_memory=True)
    host.copy_(shown, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return SampledTokens(next_input, host, ready)
