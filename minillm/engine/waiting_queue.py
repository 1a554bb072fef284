"""WaitingQueue: the scheduler's waiting sequences, in (priority, arrival) order, with O(log n)
admission and O(1) removal (chapter 07).

A plain list sorted every step and searched on every removal costs O(n) per abort: a client that
leaves with 20,000 queued prompts then costs O(n^2), and nobody else gets a step meanwhile. Here a
binary heap holds (key, version, seq_id) entries and a dict holds the live members:

    push      O(log n)   a new entry on the heap, the member recorded with its version
    remove    O(1)       the member is forgotten; its heap entry is left behind, stale
    peek/pop  O(log n)   stale entries at the top (removed, or pushed again since) are dropped first

Stale entries are dropped lazily; when they outnumber the live ones the heap is rebuilt from the
live members (O(n), at most once per n removals: O(1) amortized), so memory stays O(live).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from ..sequence import Sequence


class WaitingQueue:
    def __init__(self, key: Callable[[Sequence], tuple]):
        self._key = key  # seq -> (priority, arrival, seq_id): unique, so entries never compare sequences
        self._heap: list[tuple[tuple, int, int]] = []  # (key, version, seq_id)
        self._members: dict[int, tuple[int, Sequence]] = {}  # seq_id -> (version of its live entry, seq)
        self._versions = itertools.count()

    def append(self, seq: Sequence) -> None:
        """Queue seq in its key's place (again, if it was queued: the older entry goes stale)."""
        version = next(self._versions)
        self._members[seq.seq_id] = (version, seq)
        heapq.heappush(self._heap, (self._key(seq), version, seq.seq_id))

    def discard(self, seq: Sequence) -> bool:
        """Forget seq if it is queued; -> whether it was. O(1)."""
        entry = self._members.get(seq.seq_id)
        if entry is None or entry[1] is not seq:
            return False
        del self._members[seq.seq_id]
        if len(self._heap) > 2 * len(self._members) + 64:  # mostly stale: rebuild from the live members
            self._heap = [(self._key(s), v, sid) for sid, (v, s) in self._members.items()]
            heapq.heapify(self._heap)
        return True

    def remove(self, seq: Sequence) -> None:
        """list.remove's contract: ValueError if seq is not queued."""
        if not self.discard(seq):
            raise ValueError(f"sequence {seq.seq_id} is not waiting")

    def peek(self) -> Sequence:
        """The first sequence in (priority, arrival) order; IndexError when empty."""
        heap, members = self._heap, self._members
        while heap:
            _, version, sid = heap[0]
            entry = members.get(sid)
            if entry is not None and entry[0] == version:
                return entry[1]
            heapq.heappop(heap)  # stale: removed, or queued again under a newer version
        raise IndexError("peek from an empty WaitingQueue")

    def popleft(self) -> Sequence:
        seq = self.peek()
        heapq.heappop(self._heap)
        del self._members[seq.seq_id]
        return seq

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __contains__(self, seq: Sequence) -> bool:
        entry = self._members.get(seq.seq_id)
        return entry is not None and entry[1] is seq

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting sequences in (priority, arrival) order (O(n log n): for inspection, not the hot path)."""
        return iter(sorted((s for _, s in self._members.values()), key=self._key))
