"""Rejection sampling: verify k draft tokens against the target model in one step (chapter 09).

A proposer guesses k tokens d_1..d_k after a sequence's last token; the target model runs once on
the last token and the k guesses and gives k + 1 distributions p_1..p_{k+1} (row j: the target's
distribution for the token after d_{j-1}). Walking the rows in order:

    greedy   accept d_j while d_j == argmax p_j; the first mismatch emits argmax p_j instead.
    random   accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j the distribution the
             draft was sampled from; on the first rejection emit a token from the residual
             max(p_j - q_j, 0), normalized (Leviathan et al. 2023, Chen et al. 2023).
    both     if all k are accepted, row k + 1 gives one more token for free: the bonus token.

So every step emits between 1 and k + 1 tokens, and the random rule emits each token with exactly
the target's probability: P(x) = min(p, q)(x) + (1 - sum min(p, q)) * residual(x) = p(x).
A proposer without probabilities (n-gram lookup) proposes a fixed token: q = one-hot(d_j), so d_j
is accepted with probability p_j(d_j) and the residual is p_j with d_j removed.

p and q are the *filtered* distributions: temperature, top-k, top-p and min-p apply to the target's
rows (and, in the draft-model proposer, to the draft's) exactly as the plain sampler applies them.
Randomness is counter-based (rng.py): the acceptance coin of output position t uses stream
(seed ^ ACCEPT_STREAM, t), the emitted token of position t the sampler's own (seed, t), so with k = 0
this is the plain sampler, and a seeded request gets the same tokens alone or in any batch.

Penalties, logprobs and min_tokens make p depend on the tokens just accepted; the engine gives such
requests no drafts (LLMEngine), so they never come here.
"""

from __future__ import annotations

import itertools

import torch

from .rng import uniforms
from .sampler import SamplingMetadata, filtered_probs

ACCEPT_STREAM = 0x2545F4914F6CDD1D  # seeds ^ this: the acceptance coins' stream
DRAFT_STREAM = 0x5851F42D4C957F2D  # seeds ^ this: a draft model's own sampling (spec_decode/)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N, V] the distribution to resample from after a rejection, up to a constant: max(p - q, 0).
    (The exponential race below picks token i with probability r_i / sum(r), so no division.)"""
    return (p - q).clamp_min(0.0)


def race(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N, V] weights -> [N] one token per row, token i with probability probs_i / sum(probs) (the
    sampler's exponential race, on the same counter-based uniforms)."""
    return (probs / -torch.log(uniforms(seeds, steps, probs.shape[1]))).argmax(dim=-1)


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, num_draft: list[int], draft_token_ids: list[int],
                 draft_probs: torch.Tensor | None, meta: SamplingMetadata) -> list[list[int]]:
        """Verify every sequence's drafts; -> per sequence the tokens it emits (1 to k_b + 1).

        logits:          [R, V] target logits, sequence b's k_b + 1 rows together (R = sum(k_b + 1))
        num_draft:       [B] k_b, the drafts of sequence b (0 is allowed: one plain sampled token)
        draft_token_ids: [D] the drafts, flattened in the same order (D = sum(k_b))
        draft_probs:     [D, V] q of each draft row, or None: drafts without probabilities (one-hot q)
        meta:            per *row* of logits: sampling parameters, seeds, and steps = the row's
                         output position (len(output_ids) + j for the j-th row of a sequence)
        """
        R, V = logits.shape
        D = len(draft_token_ids)
        if R != sum(num_draft) + len(num_draft) or D != sum(num_draft):
            raise ValueError(f"RejectionSampler: {R} logits rows and {D} drafts do not fit num_draft={num_draft}")
        if draft_probs is not None and tuple(draft_probs.shape) != (D, V):
            raise ValueError(f"RejectionSampler: draft_probs is {tuple(draft_probs.shape)}, expected ({D}, {V})")
        dev = logits.device
        rows = draft_rows_of(num_draft)
        draft_rows = torch.tensor(rows, dtype=torch.long, device=dev)  # [D]
        drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=dev)  # [D]
        greedy = meta.temperature == 0  # [R]
        # [R] greedy rows' answer, whether it accepts or replaces; a NaN is never it (the Sampler's guard:
        # NaN counts as -inf, +inf as the largest float)
        best, tokens = logits.nan_to_num(nan=float("-inf")).max(dim=-1)
        # rows with no token to give: nothing finite, or a sampled row whose distribution is NaN
        broken = (best == float("-inf")) | (~greedy & logits.isnan().any(dim=-1))  # [R]
        accepted = drafts == tokens[draft_rows]  # [D] greedy rule
        if not bool(greedy.all()):
            probs = filtered_probs(logits, meta)  # [R, V] p
            if draft_probs is None:  # one-hot q: accept with p(d), resample from p without d
                q = torch.zeros(D, V, device=dev).scatter_(1, drafts[:, None], 1.0)  # [D, V]
            else:
                q = draft_probs.to(dev, torch.float32)
            p_d = probs[draft_rows, drafts]  # [D]
            q_d = q.gather(1, drafts[:, None])[:, 0]  # [D]
            coins = uniforms(meta.seeds[draft_rows] ^ ACCEPT_STREAM, meta.steps[draft_rows], 1)[:, 0]  # [D]
            accepted = torch.where(greedy[draft_rows], accepted, coins * q_d <= p_d)  # u < p/q, without 0/0
            weights = probs.clone()  # bonus rows sample p itself
            residual = residual_probs(probs[draft_rows], q)  # [D, V]
            # p == q leaves nothing (a rejection then had probability 0; floats may still get there): use p
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            weights[draft_rows] = torch.where(empty, probs[draft_rows], residual)
            tokens = torch.where(greedy, tokens, race(weights, meta.seeds, meta.steps))
        if bool(broken.any()):  # no token to verify against: the request fails, its rows named
            rows = broken.nonzero()[:, 0].tolist()
            raise ValueError(f"RejectionSampler: the target's logits of row(s) {rows} have no finite value (or "
                             "a NaN in a sampled row): the model's output is broken, there is no token to verify against")
        return emit(num_draft, draft_token_ids, accepted.tolist(), tokens.tolist())


def draft_rows_of(num_draft: list[int]) -> list[int]:
    """[D] the logits row of each draft: sequence b's rows start at start_b, its drafts are start_b + j."""
    starts = itertools.accumulate([k + 1 for k in num_draft], initial=0)
    return [start + j for start, k in zip(starts, num_draft) for j in range(k)]


def emit(num_draft: list[int], draft_token_ids: list[int], accepted: list[bool], tokens: list[int]) -> list[list[int]]:
    """Per sequence, the tokens a verify emits: its drafts while accepted, then the first rejected one's
    replacement and nothing after it, or, every draft accepted, the bonus token of its last row.
    accepted [D] per draft; tokens [R] per row of logits (sequence b's k_b + 1 rows together)."""
    out, d, start = [], 0, 0
    for k in num_draft:
        emitted = []
        for j in range(k):
            if not accepted[d + j]:
                emitted.append(tokens[start + j])  # the replacement, and nothing after it
                break
            emitted.append(draft_token_ids[d + j])
        else:
            emitted.append(tokens[start + k])  # every draft accepted: the bonus token
        out.append(emitted)
        d, start = d + k, start + k + 1
    return out


def spec_metadata(params: list, seeds: list[int], num_output: list[int], num_draft: list[int], vocab_size: int,
                  device) -> SamplingMetadata:
    """The per-row SamplingMetadata of a verify step: sequence b's params and seed on each of its
    k_b + 1 rows, and steps = its output position there (num_output[b] + j)."""
    if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
        raise ValueError("speculative rows cannot carry penalties: they depend on the tokens accepted before them")
    rows = [b for b, k in enumerate(num_draft) for _ in range(k + 1)]
    steps = [num_output[b] + j for b, k in enumerate(num_draft) for j in range(k + 1)]
    empty = [[] for _ in rows]
    meta = SamplingMetadata.build([params[b] for b in rows], empty, empty, [seeds[b] for b in rows], empty,
                                  vocab_size, device)
    meta.steps = torch.tensor(steps, dtype=torch.int64, device=device)  # [R]
    return meta
