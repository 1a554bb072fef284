"""The batched sampler: logits of many sequences in, one token each out, every row its own settings.

Per-row parameters live in tensors ([rows] or [rows, vocab]) so every step below is a few batched
GPU operations, with no Python loop over rows:

    1. penalties: repetition (prompt and output tokens), presence and frequency (output tokens)
    2. banned tokens (EOS and stop tokens before min_tokens) -> -inf
    3. greedy rows: argmax, done
    4. temperature, then top-k, top-p and min-p filtering (the order of HF `generate`)
    5. sample by exponential race: argmax(p / E) with E ~ Exp(1) from counter-based uniforms, which
       picks token i with probability p_i (the first of n exponential clocks to ring, with rates p_i)
    6. guard: a row whose scores are NaN, all -inf, or overflowed float32 is never sampled as token 0
       (argmax's answer for such a row); it falls back to its argmax of finite scores (`_fallback_tokens`)

Log-probabilities are reported from the model's raw logits (before penalties and filters), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rng import uniforms
from .sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: how many tokens the sequence has generated (the RNG counter)
    prompt_mask: torch.Tensor | None  # [B, V] bool, tokens of the prompt (only with repetition penalty)
    output_counts: torch.Tensor | None  # [B, V] float32, occurrences in the output (only with penalties)
    banned: torch.Tensor | None  # [B, V] bool
    num_logprobs: int  # top log-probabilities to return (0: only the sampled token's; -1: none)

    @classmethod
    def build(cls, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
              seeds: list[int], banned: list[list[int]], vocab_size: int, device,
              steps: list[int] | None = None) -> SamplingMetadata:
        """steps: each row's RNG counter, when it is not len(outputs[i]) (a token still on the GPU)."""
        B, V = len(params), vocab_size

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        rep = any(p.repetition_penalty != 1.0 for p in params)
        pen = rep or any(p.presence_penalty or p.frequency_penalty for p in params)
        return cls(
            temperature=col([0.0 if p.greedy else p.temperature for p in params]),  # below 1e-5: greedy
            top_k=col([p.top_k if p.top_k > 0 else V for p in params], torch.int64),
            top_p=col([p.top_p for p in params]),
            min_p=col([p.min_p for p in params]),
            repetition_penalty=col([p.repetition_penalty for p in params]),
            presence_penalty=col([p.presence_penalty for p in params]),
            frequency_penalty=col([p.frequency_penalty for p in params]),
            seeds=col(seeds, torch.int64),
            steps=col([len(o) for o in outputs] if steps is None else steps, torch.int64),
            prompt_mask=_token_counts(prompts, B, V, device) > 0 if rep else None,
            output_counts=_token_counts(outputs, B, V, device) if pen else None,
            banned=_token_counts(banned, B, V, device) > 0 if any(banned) else None,
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )


def _token_counts(rows: list[list[int]], B: int, V: int, device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row (one scatter for the whole batch)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((B, max(width, 1)), V, dtype=torch.int64)  # pad with a spare column V
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    counts = torch.zeros(B, V + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :V]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log p(sampled token) under the raw logits
    ranks: torch.Tensor | None  # [B] int64: 1 = the most likely token
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, raw: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [B, V] float32 -> one token per row. raw: the model's logits before the step's token
        masks (token_mask.py), for the log-probabilities (default: logits)."""
        raw = logits if raw is None else raw
        if meta.banned is not None:  # a caller that did not mask already (chapter 03's one request)
            logits = logits.masked_fill(meta.banned, float("-inf"))
        allowed = logits
        logits = apply_penalties(logits, meta)
        greedy = meta.temperature == 0
        token_ids = logits.argmax(dim=-1)
        # a row is broken when its scores hold a NaN (argmax would pick it) or nothing above -inf (argmax
        # would pick token 0): [B] bool
        broken = logits.isnan().any(dim=-1) | (logits.amax(dim=-1) == float("-inf"))
        if not bool(greedy.all()):
            probs = filtered_probs(logits, meta)
            race = probs / -torch.log(uniforms(meta.seeds, meta.steps, probs.shape[1]))  # p_i / E_i
            token_ids = torch.where(greedy, token_ids, race.argmax(dim=-1))
            # logits / temperature or a penalty may overflow float32 (+inf -> NaN after the softmax)
            broken |= ~greedy & (probs.isnan().any(dim=-1) | ~(probs.sum(dim=-1) > 0))
        if bool(broken.any()):
            token_ids = torch.where(broken, _fallback_tokens(allowed, logits, meta, broken), token_ids)
        return self._logprobs(raw, token_ids, meta.num_logprobs)

    @staticmethod
    def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
        if k < 0:
            return SamplerOutput(token_ids, None, None, None, None)
        logp = torch.log_softmax(raw, dim=-1)  # [B, V]
        chosen = logp.gather(1, token_ids[:, None])  # [B, 1]
        ranks = (logp > chosen).sum(dim=-1) + 1
        top = logp.topk(k, dim=-1) if k > 0 else None
        return SamplerOutput(token_ids, chosen[:, 0], ranks, top and top.indices, top and top.values)


def logprob_lists(out: SamplerOutput, num_logprobs: list[int | None]) -> tuple[list[int], list]:
    """SamplerOutput -> (token ids, per row None or (logprob, rank, top ids, top logprobs)): plain data
    for the engine, which decodes the texts (each row keeps its own request's top-k)."""
    ids = out.token_ids.tolist()
    if out.logprobs is None:
        return ids, [None] * len(ids)
    lps, ranks = out.logprobs.tolist(), out.ranks.tolist()
    tops = (out.top_ids.tolist(), out.top_logprobs.tolist()) if out.top_ids is not None else None
    rows = []
    for r, k in enumerate(num_logprobs):
        if k is None:
            rows.append(None)
        else:
            rows.append((lps[r], ranks[r], tops[0][r][:k] if tops else [], tops[1][r][:k] if tops else []))
    return ids, rows


def _fallback_tokens(allowed: torch.Tensor, logits: torch.Tensor, meta: SamplingMetadata,
                     broken: torch.Tensor) -> torch.Tensor:
    """[B] the token of each broken row: never a NaN's position, never a silent token 0.

    A row whose distribution cannot be computed (NaN or inf logits from the model, or a penalty or
    temperature that overflowed float32) is sampled greedily instead: the argmax of its scores after
    penalties and bans, NaN ignored and +inf counted as the largest (that is the limit the overflow
    stood for, and it lies inside every top-k / top-p / min-p set). If nothing is left above -inf,
    the argmax of the model's raw finite logits among the allowed tokens. A row with no such value at
    all has no token to give, and the sampler raises a ValueError naming it.
    """
    neg_inf = float("-inf")
    scores = logits.nan_to_num(nan=neg_inf, posinf=torch.finfo(logits.dtype).max, neginf=neg_inf)  # [B, V]
    # the model's logits with the step's masks (banned tokens -inf), before penalties
    plain = allowed.nan_to_num(nan=neg_inf, posinf=torch.finfo(allowed.dtype).max, neginf=neg_inf)  # [B, V]
    scores = torch.where((scores.amax(dim=-1) == neg_inf)[:, None], plain, scores)
    empty = broken & (scores.amax(dim=-1) == neg_inf)
    if bool(empty.any()):
        rows = empty.nonzero()[:, 0].tolist()
        raise ValueError(f"Sampler: the logits of row(s) {rows} have no finite value for an allowed token "
                         f"(all NaN or -inf, or banned): the model's output is broken, there is no token to pick")
    return scores.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.prompt_mask is not None:  # repetition: shrink the logits of every token already seen
        seen = meta.prompt_mask | (meta.output_counts > 0)
        rp = meta.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if meta.output_counts is not None:  # OpenAI-style: a flat and a per-occurrence charge
        counts = meta.output_counts
        logits = logits - meta.frequency_penalty[:, None] * counts - meta.presence_penalty[:, None] * (counts > 0)
    return logits


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata,
                   filters: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p -> the distribution to sample from, [B, V]. filters: (some row
    has top-k or top-p, some row has min-p) when the caller knows it from the requests' parameters;
    None reads it from the tensors (a wait for the GPU: chapter 13's overlap passes it)."""
    V = logits.shape[1]
    temp = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    logits = logits / temp[:, None]
    if filters is None:
        filters = (bool((meta.top_k < V).any() or (meta.top_p < 1).any()), bool((meta.min_p > 0).any()))
    if filters[0]:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        kth = sorted_logits.gather(1, (meta.top_k - 1).clamp(0, V - 1)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with kth stay
        p = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # probability of the tokens ranked above each one
        sorted_logits = sorted_logits.masked_fill(before >= meta.top_p[:, None], float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if filters[1]:
        floor = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
