"""The engine's half of the step message: its Sequence objects -> a ModelInput of plain data (chapter 13).

The scheduler says who runs and how many new tokens each brings; this module writes that down as the
ModelInput the worker runs (worker/model_input.py): the tokens, their positions and cache slots, the
block-table changes since the last step, and which rows the worker samples, with what parameters.
It is the only place that reads Sequence objects to build a step: the worker sees lists of numbers,
which is what lets it live in another process (chapter 11) or be replaced by a fake (tests).
"""

from __future__ import annotations

from ..sequence import Sequence, new_tokens
from ..worker.model_input import ModelInput, SamplingInput, pack


def prepare_model_input(scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]],
                        block_size: int, logits_indices: list[int], table_changes=None) -> ModelInput:
    """The scheduler's (sequence, new tokens) pairs -> the step's ModelInput (engine side). A sequence's
    token still on the GPU (Sequence.num_pending) becomes a row the worker fills from the previous
    step's sampled tokens. table_changes: BlockManager.take_table_changes() of this step, for a worker
    that keeps the block tables (then no padded [B, W] table is built here)."""
    step = pack([(s.num_computed_tokens, new_tokens(s, s.num_computed_tokens, n), block_tables[s.seq_id])
                 for s, n in scheduled], block_size, logits_indices, pad_tables=table_changes is None)
    if table_changes is not None:
        step.dropped_tables, step.table_updates = table_changes
        step.seq_ids = [s.seq_id for s, _ in scheduled]
    offset = 0
    for s, n in scheduled:
        if s.num_pending:
            at = s.num_tokens - 1 - s.num_computed_tokens  # the pending token's place in this chunk
            if 0 <= at < n:
                step.prev_token_dst.append(offset + at)
                step.prev_token_src.append(s.pending_row)
        offset += n
    return step


def prepare_decode_input(seqs: list[Sequence], block_tables: dict[int, list[int]], block_size: int,
                         table_changes=None) -> ModelInput:
    """prepare_model_input for a step where every sequence runs one token, its last, and samples
    (SchedulerOutput.decode_only): the same ModelInput, built column by column without the general
    path's per-sequence chunk lists (at batch 256 those were a third of the engine's packing time)."""
    pos = [s.num_computed_tokens for s in seqs]  # [B]: the one new token's position, num_tokens - 1
    tables = [block_tables[s.seq_id] for s in seqs]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pos)]  # [B]
    step = ModelInput([s.last_token_id for s in seqs], pos, slots, [p + 1 for p in pos], [], [1] * len(seqs),
                      list(range(len(seqs))))
    if table_changes is None:
        width = max(map(len, tables), default=0)
        step.block_table = [t + [0] * (width - len(t)) for t in tables]
    else:
        step.dropped_tables, step.table_updates = table_changes
        step.seq_ids = [s.seq_id for s in seqs]
    # the tokens still on the GPU (-1 above): row i takes the previous step's sampled token pending_row
    step.prev_token_dst = [i for i, s in enumerate(seqs) if s.num_pending]
    step.prev_token_src = [seqs[i].pending_row for i in step.prev_token_dst]
    return step


def sampling_input(seqs: list[Sequence], rows: list[int], on_device: bool = False,
                   bitmask=None, defer_bitmask: bool = False) -> SamplingInput:
    """How the worker samples this step (worker/sample_step.py): seqs in the order of the answer, each
    with its first logits row (rows). A sequence with drafts verifies them on its next k rows.
    bitmask: the grammars' allowed tokens, a row per sequence (engine/structured_output.py);
    defer_bitmask: it comes later, with the executor's sample_tokens (overlap_steps.py)."""
    params = [s.params for s in seqs]
    penalties = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
    drafting = [s for s in seqs if s.spec_token_ids]
    probs = [s.spec_probs for s in drafting]
    return SamplingInput(
        rows, [len(s.spec_token_ids) for s in seqs], [t for s in drafting for t in s.spec_token_ids], params,
        [s.seed for s in seqs], [len(s.output_ids) + s.num_pending for s in seqs], [s.banned_tokens() for s in seqs],
        [s.prompt_ids for s in seqs] if penalties else None, [s.output_ids for s in seqs] if penalties else None,
        probs if probs and all(p is not None for p in probs) else None, on_device, bitmask, defer_bitmask)
