"""The target's last hidden states, kept in the worker for a learned drafter (chapter 09, part two).

Medusa heads and an EAGLE draft layer read what the target's LM head reads: the final (normed) hidden
state h_p of each computed position p. A step's forward pass makes them for every token it runs, and
they never cross the seam to the engine: the worker keeps the last few steps' [T, hidden] tensors as
they are, with a dict from sequence to its rows (no per-sequence copy: a step costs one clone and a
`dict(zip(...))`), and the proposer gathers what it needs when it drafts:

    Medusa   h at the sequence's last computed position (the row that sampled its last token)
    EAGLE    h at every position since its draft layer last caught up (a prompt's: all of them)

Which rows are still true needs no word from the sampler. A verify step computes positions past what
it accepts, but every position a sequence now counts as computed was computed last by the newest step
that covered it (a rejected draft's position is computed again before it counts), so reading each
position from the newest step that has it gives the target's h for the tokens the sequence holds.
A sequence not seen for `depth` steps (its prompt chunked over many steps, drafting off for a while)
has lost its oldest rows: the drafter starts from the first one it still has.
"""

from __future__ import annotations

from collections import deque

import torch


class StepHidden:
    """One step's hidden states and where each sequence's rows are."""

    def __init__(self, hidden: torch.Tensor, seq_ids: list[int], query_lens: list[int], seq_lens: list[int]):
        self.hidden = hidden  # [T, hidden]
        starts, row = [], 0
        for n in query_lens:
            starts.append(row)
            row += n
        # seq_id -> (first row, first position, rows): the step ran positions [pos, pos + n) of the sequence
        self.where = dict(zip(seq_ids, zip(starts, [s - n for s, n in zip(seq_lens, query_lens)], query_lens)))


class HiddenStates:
    def __init__(self, depth: int = 8):
        self.steps: deque[StepHidden] = deque(maxlen=depth)  # newest last

    def record(self, hidden: torch.Tensor, seq_ids: list[int], query_lens: list[int], seq_lens: list[int]) -> None:
        """After a forward pass: hidden [T, hidden] of its tokens (cloned by the caller when a graph's
        static buffer holds it)."""
        if seq_ids:
            self.steps.append(StepHidden(hidden, seq_ids, query_lens, seq_lens))

    def gather(self, seq_id: int, first: int, last: int) -> tuple[int, torch.Tensor | None]:
        """h at positions [first', last] of a sequence, first' >= first the earliest position from which
        every one up to last is still held -> (first', [last - first' + 1, hidden]); (last + 1, None)
        when not even h_last is held."""
        pieces: list[torch.Tensor] = []  # newest first: each covers positions [lo, hi] below the last one
        hi = last
        for step in reversed(self.steps):
            w = step.where.get(seq_id)
            if w is None:
                continue
            row, pos, n = w
            if pos > hi or pos + n - 1 < hi:  # this step has not got position hi (a gap: stop at it)
                if pos + n - 1 < hi:
                    break
                continue
            lo = max(pos, first)
            pieces.append(step.hidden[row + lo - pos : row + hi - pos + 1])  # [hi - lo + 1, hidden]
            hi = lo - 1
            if hi < first:
                break
        if not pieces:
            return last + 1, None
        return hi + 1, torch.cat(pieces[::-1]) if len(pieces) > 1 else pieces[0]

    def last_rows(self, seq_ids: list[int], positions: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """h at one position per sequence -> (the indices i whose h is held, [len, hidden] of those):
        what Medusa drafts from."""
        found, rows = [], []
        for i, (sid, p) in enumerate(zip(seq_ids, positions)):
            _, h = self.gather(sid, p, p)
            if h is not None:
                found.append(i)
                rows.append(h)
        return found, torch.cat(rows) if rows else None

    def clear(self) -> None:
        self.steps.clear()
