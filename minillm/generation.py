"""Generating a request's tokens: all n sequences of one request, stepped together.

    for each step:  run the model on each sequence's new tokens (packed into one batch)
                    -> logits at each sequence's last token -> the batched Sampler -> append, check stops

With the KV cache (chapter 03, the default) a sequence's "new tokens" are the whole prompt on the
first step (prefill) and then the one token sampled last (decode); the keys and values of the rest
are read from the cache. Without it (`use_kv_cache=False`, chapter 02) every step recomputes the
prompt and everything generated so far: step t costs P + t tokens and N tokens cost O(N^2) work.
Both paths give the same tokens: tests/test_kv_cache.py holds them to it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .cache import KVCache
from .forward_context import set_forward_context
from .layers import AttentionMetadata
from .sampling import Sampler, SamplingMetadata, SamplingParams
from .sequence import Sequence, append_tokens, make_sequences, sequence_seed

__all__ = ["append_tokens", "generate_sequences", "make_sequences", "prepare_inputs", "sequence_seed"]

@torch.inference_mode()
def generate_sequences(model, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids: list[int],
                       sampler: Sampler | None = None, use_kv_cache: bool = True) -> Iterator[list[Sequence]]:
    """Run one request to the end, yielding its sequences after every step (for streaming)."""
    config = model.config
    param = next(model.parameters())
    sampler = sampler or Sampler()
    seqs = make_sequences(prompt_ids, params, tokenizer, eos_ids, config.max_position_embeddings)
    cache = None
    if use_kv_cache:  # one slot per sequence, each long enough for the longest it may grow
        ctx = config.max_position_embeddings
        max_len = min(len(prompt_ids) + (params.max_tokens or ctx), ctx)
        cache = KVCache.for_model(model, params.n, max_len)
        cache.bind(model)
    slots = [cache.allocate() if cache is not None else -1 for _ in seqs]
    num_computed = [0] * len(seqs)  # tokens of each sequence whose K/V are in the cache
    try:
        while active := [s for s in seqs if not s.finished]:
            input_ids, positions, meta = prepare_inputs(active, [slots[s.index] for s in active],
                                                        [num_computed[s.index] for s in active], cache, param.device)
            with set_forward_context(meta):
                hidden = model(input_ids, positions, meta)  # [T, hidden]
            logits = model.compute_logits(hidden[meta.last_token_indices])  # [num_seqs, vocab]
            if cache is not None:
                for s in active:
                    num_computed[s.index] = len(s.token_ids)
            smeta = SamplingMetadata.build([s.params for s in active], [s.prompt_ids for s in active],
                                           [s.output_ids for s in active], [s.seed for s in active],
                                           [s.banned_tokens() for s in active], logits.shape[1], param.device)
            out = sampler(logits, smeta)
            append_tokens(active, out, tokenizer)
            yield seqs
    finally:
        if cache is not None:
            cache.unbind(model)  # the request is over: let its cache memory go


def prepare_inputs(seqs: list[Sequence], slots: list[int], num_computed: list[int], cache: KVCache | None,
                   device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Pack the sequences' new tokens into one batch: input_ids [T], positions [T], metadata.

    Without a cache every token is new. With one, the tokens past `num_computed` are: the whole
    prompt at prefill, one token per decode step. Each new token at position p of the sequence in
    slot s writes its K/V to cache row s * max_len + p (the slot mapping) and attends over all
    p + 1 keys of its sequence (seq_lens), found through a one-column block table.
    """
    if cache is None:
        num_computed = [0] * len(seqs)
    seq_lens = [len(s.token_ids) for s in seqs]
    ids = [t for s, done in zip(seqs, num_computed) for t in s.token_ids[done:]]
    pos = [p for n, done in zip(seq_lens, num_computed) for p in range(done, n)]
    input_ids = torch.tensor(ids, device=device)  # [T]
    positions = torch.tensor(pos, device=device)  # [T]
    meta = AttentionMetadata.from_seq_lens([n - done for n, done in zip(seq_lens, num_computed)], device)
    if cache is not None:
        slot_mapping = [row for slot, n, done in zip(slots, seq_lens, num_computed)
                        for row in cache.slot_mapping(slot, done, n)]
        meta.slot_mapping = torch.tensor(slot_mapping, dtype=torch.int64, device=device)  # [T]
        meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)  # [num_seqs]
        meta.block_table = torch.tensor(slots, dtype=torch.int32, device=device)[:, None]  # [num_seqs, 1]
    return input_ids, positions, meta
