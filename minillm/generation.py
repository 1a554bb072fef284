"""Generating a request's tokens, the simplest correct way: recompute everything every step.

    for each step:  run the model on prompt + output so far (all n sequences packed into one batch)
                    -> logits at each sequence's last token -> the batched Sampler -> append, check stops

There is no KV cache yet, so step t costs a forward pass over all P + t tokens: generating N tokens
does O(N^2) work. Chapter 03 keeps the keys and values and makes each step cost one token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from .layers import AttentionMetadata
from .outputs import Logprob
from .sampling import Sampler, SamplingMetadata, SamplingParams
from .sequence import Sequence

_GOLDEN = 0x9E3779B97F4A7C15


def sequence_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request whose seed is `seed` (completion 0 keeps it)."""
    return (seed + index * _GOLDEN) % (1 << 63)


@torch.inference_mode()
def generate_sequences(model, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids: list[int],
                       sampler: Sampler | None = None) -> Iterator[list[Sequence]]:
    """Run one request to the end, yielding its sequences after every step (for streaming)."""
    config = model.config
    device = next(model.parameters()).device
    sampler = sampler or Sampler()
    base = random.SystemRandom().randrange(1 << 62) if params.seed is None else params.seed  # unseeded: fresh
    seqs = [Sequence(i, prompt_ids, params, sequence_seed(base, i), tokenizer, eos_ids,
                     config.max_position_embeddings) for i in range(params.n)]
    while active := [s for s in seqs if not s.finished]:
        lens = [len(s.token_ids) for s in active]
        input_ids = torch.tensor([t for s in active for t in s.token_ids], device=device)  # [T]
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)  # [T]
        meta = AttentionMetadata.from_seq_lens(lens, device)
        hidden = model(input_ids, positions, meta)  # [T, hidden]
        logits = model.compute_logits(hidden[meta.last_token_indices])  # [num_seqs, vocab]
        smeta = SamplingMetadata.build([s.params for s in active], [s.prompt_ids for s in active],
                                       [s.output_ids for s in active], [s.seed for s in active],
                                       [s.banned_tokens() for s in active], logits.shape[1], device)
        out = sampler(logits, smeta)
        _append(active, out, tokenizer)
        yield seqs


def _append(active: list[Sequence], out, tokenizer) -> None:
    ids = out.token_ids.tolist()
    if out.logprobs is None:
        for s, t in zip(active, ids):
            s.append(t)
        return
    lps, ranks = out.logprobs.tolist(), out.ranks.tolist()
    tops = (out.top_ids.tolist(), out.top_logprobs.tolist()) if out.top_ids is not None else None
    for row, (s, t) in enumerate(zip(active, ids)):
        entry = {t: Logprob(lps[row], ranks[row], tokenizer.decode([t]))}
        if tops is not None:
            k = s.params.logprobs or 0
            for rank, (tid, lp) in enumerate(zip(tops[0][row][:k], tops[1][row][:k]), start=1):
                entry.setdefault(tid, Logprob(lp, rank, tokenizer.decode([tid])))
        s.append(t, lps[row], entry)
