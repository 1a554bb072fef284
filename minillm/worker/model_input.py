"""ModelInput: one engine step as plain data, the message from the engine to its executor (chapter 13).

The engine decides *what* runs (the scheduler's sequences and how many new tokens each brings); the
worker that owns the model only needs the step's tokens and where their keys and values live. So the
engine packs each step into lists of numbers, with no padding (chapter 02's layout) and the paged
cache's addresses (chapter 05), for the sequences scheduled with n new tokens each:

    input_ids, positions  [T]        the new tokens and their positions (T = sum of the n's)
    slot_mapping          [T]        cache row of each new token: table[p // bs] * bs + p % bs
    seq_lens              [B]        keys per sequence after this step (cached + new)
    block_table           [B, W]     each sequence's blocks, padded with 0 to the widest
    query_lens            [B]        the n's
    logits_indices        [R]        the token rows whose logits the step returns
    prev_token_dst/src               (chapter 13) rows whose token the GPU sampled last step, and
                                     which row of that step's sampled tokens each takes
    seq_ids, table_updates,          (chapter 13) instead of block_table: the sequences in order, and
    dropped_tables                   what changed in the block tables since the last step; the worker
                                     keeps the tables (worker/block_table.py) and gathers [B, W] itself

Plain data is what lets the worker live elsewhere: in this process (UniprocExecutor), or once per GPU
in processes of its own (chapter 11), each receiving the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sequence import Sequence


@dataclass
class ModelInput:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    seq_lens: list[int]  # [B]
    block_table: list[list[int]]  # [B, W]
    query_lens: list[int]  # [B]
    logits_indices: list[int]  # [R]
    # overlap scheduling (chapter 13): input_ids[prev_token_dst[i]] is -1 here and takes the previous
    # step's sampled token prev_token_src[i], on the GPU, before the forward pass
    prev_token_dst: list[int] = field(default_factory=list)
    prev_token_src: list[int] = field(default_factory=list)
    # the persistent block table (chapter 13): with seq_ids set, block_table is empty and the worker
    # builds it from its own copy after applying dropped_tables, then table_updates (seq_id, start, entries)
    seq_ids: list[int] = field(default_factory=list)
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    dropped_tables: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def new_tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without building the whole list (decode: one token); past the
    sequence's end, its draft tokens of this step (chapter 09: verified beside the last token). A token
    still on its way from the GPU (chapter 13's overlap: Sequence.num_pending) reads as -1."""
    P, end, pending = len(seq.prompt_ids), seq.num_tokens, seq.num_pending
    if pending and start + n > end - pending:
        known = end - pending
        if start >= known:  # the common overlapped decode: the one new token is still on the GPU
            return [-1] * n
        return new_tokens(seq, start, known - start) + [-1] * (start + n - known)
    if start + n > end:
        return new_tokens(seq, start, end - start) + seq.spec_token_ids[: start + n - end]
    if start >= P:
        return seq.output_ids[start - P : start - P + n]
    return (seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - P)])[:n]


def pack(chunks: list[tuple[int, list[int], list[int]]], block_size: int,
         logits_indices: list[int] | None = None, pad_tables: bool = True) -> ModelInput:
    """(start position, new token ids, block table) per sequence -> the step's ModelInput; logits at
    logits_indices (default: each sequence's last new token). pad_tables=False leaves block_table
    empty (the worker keeps the tables: prepare_model_input's table_changes)."""
    ids, pos, slots, seq_lens, tables, lens = [], [], [], [], [], []
    for start, tokens, table in chunks:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        seq_lens.append(start + n)
        tables.append(table)
        lens.append(n)
    if logits_indices is None:
        logits_indices, end = [], 0
        for n in lens:
            end += n
            logits_indices.append(end - 1)
    width = max(len(t) for t in tables) if pad_tables else 0
    padded = [t + [0] * (width - len(t)) for t in tables] if pad_tables else []
    return ModelInput(ids, pos, slots, seq_lens, padded, lens, list(logits_indices))


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
