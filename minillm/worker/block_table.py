"""PersistentBlockTable: the worker's own copy of every sequence's block table (chapter 13).

A step's attention needs a [B, W] table of block ids: row i lists the blocks of the i-th scheduled
sequence, padded with block 0 to the widest. Built from Python lists every step, that table costs
the host O(B x W) element conversions: at batch 256 with 2k-token contexts (W = 128 blocks of 16) a
torch.tensor() of the nested lists takes milliseconds, more than the GPU's whole decode step. Yet
from one step to the next almost nothing changes: a decoding sequence gains one block every
block_size tokens.

So the worker keeps the tables itself (vLLM V1's persistent batch keeps its block table the same
way): one numpy row per sequence, in an array that lives as long as the worker. Each step's message
carries only what changed (BlockManager.take_table_changes: the sequences whose table went away,
and for each changed table its entries from the first change on), and the step's [B, W] table is a
single fancy-indexing gather of the scheduled sequences' rows, in C.

Rows are exactly the block manager's lists, zero past their length, so the gathered table is the one
the lists would have made: tests/test_block_table.py checks that after random allocations, prefix
hits, copy-on-write, trims, frees and swaps.
"""

from __future__ import annotations

import numpy as np


class PersistentBlockTable:
    def __init__(self, max_rows: int = 64, max_blocks: int = 16):
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)  # [rows, blocks]
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # [rows] entries in use per row
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(max_rows - 1, -1, -1))  # popped from the end: row 0 first

    def apply(self, dropped: list[int], updates: list[tuple[int, int, list[int]]]) -> None:
        """One step's changes, dropped tables first (a row freed here may be taken by an update)."""
        for seq_id in dropped:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.table[row, : self.lengths[row]] = 0
                self.lengths[row] = 0
                self.free_rows.append(row)
        for seq_id, start, entries in updates:
            row = self.row_of.get(seq_id)
            if row is None:
                row = self.row_of[seq_id] = self._new_row()
            end = start + len(entries)
            if end > self.table.shape[1]:
                self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
            self.table[row, start:end] = entries
            old = self.lengths[row]
            if old > end:  # the table got shorter (drafts' slots trimmed): padding is block 0 again
                self.table[row, end:old] = 0
            self.lengths[row] = end

    def gather(self, seq_ids: list[int]) -> np.ndarray:
        """The step's table [len(seq_ids), W]: the rows of these sequences, W the longest of them."""
        rows = np.fromiter((self.row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))  # [B]
        width = max(int(self.lengths[rows].max()), 1) if len(rows) else 1
        return self.table[rows, :width]  # [B, W], a copy (fancy indexing)

    def row(self, seq_id: int) -> list[int]:
        """One sequence's table as a list (chapter 09's proposer packs its draft passes from it)."""
        r = self.row_of[seq_id]
        return self.table[r, : self.lengths[r]].tolist()

    def _new_row(self) -> int:
        if not self.free_rows:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def _grow(self, rows: int, blocks: int) -> None:
        table = np.zeros((rows, blocks), dtype=np.int32)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[: len(self.lengths)] = self.lengths
        self.table, self.lengths = table, lengths
