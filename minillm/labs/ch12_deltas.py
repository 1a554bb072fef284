"""Lab 12, exercise 4: merging the engine core's rows, checked against deltas.outputs_of.

The engine core publishes one row per request it changed, once per step (engine_core.py):

    (request_id, finished, error, metrics, [(index, text, token_ids, cumulative_logprob, logprobs,
                                             finish_reason, stop_reason), ...])   # one per completion with news

Each reader (one RequestStream: a request's stream, or the prompts of one batched completion) finds
the rows of its own requests in its Inbox, several steps' worth when it fell behind, and makes one
output per request of all it found. The check simulates that: random requests (1-3 completions,
logprobs or not, some aborted or failed), a few readers, engine steps that row a random subset of
the running requests (some steps row nothing for a reader, some nothing at all), and readers that
wake after a random number of steps. Each case is what one reader took at one wake-up.
"""

from __future__ import annotations

import random

from ..engine.deltas import outputs_of
from ..engine.engine_core import FinishedStats
from ..outputs import Logprob
from .checker import check

_PIECES = ["", "", " the", " cat", "é", "😀", ",", "\n", " sat", "on", " a", " mat", "."]


class _Request:
    """One simulated request: its completions' states and how to row a step of it."""

    def __init__(self, rng: random.Random, rid: str):
        self.rid, self.n = rid, rng.choice([1, 1, 1, 2, 3])
        self.logprobs = rng.random() < 0.4
        self.left = [rng.randint(1, 8) for _ in range(self.n)]  # tokens each completion still makes
        self.cumulative = [0.0] * self.n
        self.done = [False] * self.n
        self.fate = rng.choice(["ok"] * 8 + ["abort", "error"])  # how it ends
        self.step_of_fate = rng.randint(1, 6)
        self.steps = 0

    def row(self, rng: random.Random) -> tuple | None:
        """This step's row (rows only completions with news, in index order), or None: no news."""
        self.steps += 1
        ending = self.fate != "ok" and self.steps >= self.step_of_fate
        outs = []
        for i in range(self.n):
            if self.done[i] or (not ending and rng.random() < 0.25):  # no news for this completion
                continue
            k = 0 if ending else min(self.left[i], rng.choice([0, 1, 1, 1, 2, 3]))  # 0: held-back text released
            ids = [rng.randrange(50_000) for _ in range(k)]
            text = "".join(rng.choice(_PIECES) for _ in range(k or rng.randint(0, 1)))
            self.left[i] -= k
            lps = None
            if self.logprobs:
                lps = [{t: Logprob(-rng.expovariate(1.0), rng.randint(1, 5), rng.choice(_PIECES))} for t in ids]
                self.cumulative[i] += sum(next(iter(d.values())).logprob for d in lps)
            finish = stop = None
            if ending:
                finish = "abort" if self.fate == "abort" else "error"
            elif self.left[i] == 0:
                finish = rng.choice(["stop", "length"])
                stop = rng.choice([None, "\n", 2]) if finish == "stop" else None
            self.done[i] = finish is not None
            outs.append((i, text, ids, self.cumulative[i] if self.logprobs else None, lps, finish, stop))
        if not outs:
            return None
        finished = all(self.done)
        error = "the step failed: CUDA error (simulated)" if ending and self.fate == "error" else None
        reason = self.fate if ending else "stop"
        metrics = FinishedStats(0.0, 0.01, 0.5, 7, tuple(range(self.n)), reason) if finished else None
        return self.rid, finished, error, metrics, outs


def simulate_takes(rng: random.Random) -> list[list[tuple]]:
    """Every take of every reader in one simulated run, each a list of rows in step order."""
    readers = [[_Request(rng, f"cmpl-{rng.getrandbits(24):06x}-{j}") for j in range(rng.randint(1, 4))]
               for _ in range(rng.randint(1, 3))]
    reader_of = {r.rid: k for k, reqs in enumerate(readers) for r in reqs}
    running = [r for reqs in readers for r in reqs]
    inbox: list[list[tuple]] = [[] for _ in readers]
    takes: list[list[tuple]] = []
    while running or any(inbox):
        rng.shuffle(running)  # the core rows its requests in the order its batch holds them
        for req in running[: rng.randint(0, len(running))]:  # possibly none: an empty step
            row = req.row(rng)
            if row is not None:
                inbox[reader_of[row[0]]].append(row)
        running = [r for r in running if not all(r.done)]
        for k, rows in enumerate(inbox):
            if rows and (not running or rng.random() < 0.35):  # the reader wakes and takes everything
                takes.append(rows)
                inbox[k] = []
    return takes


def _take_case(rng: random.Random):
    takes = simulate_takes(rng)
    if rng.random() < 0.03:
        return ([],)  # nothing to merge
    busy = [t for t in takes if len(t) > 1]  # mostly a reader that fell behind: that is where merging happens
    return (rng.choice(busy if busy and rng.random() < 0.85 else takes),)


def _plain(x):
    """Tuples and lists alike, all the way down."""
    return [_plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def reference_merge_rows(rows):
    """outputs_of's RequestOutputs as merged rows (copied now, before the student's function runs)."""
    return [[o.request_id, o.finished, o.error, o.metrics,
             [[c.index, c.text, list(c.token_ids), c.cumulative_logprob,
               None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason] for c in o.outputs]]
            for o in outputs_of(rows, lambda rid: None)]


def check_merge_rows(fn, cases: int = 300):
    """fn(rows) -> one merged row per request, in order of first appearance, each shaped like a row:
    (request_id, finished, error, metrics, [(index, text, token_ids, cumulative_logprob, logprobs,
    finish_reason, stop_reason) per completion, in order of first appearance])."""
    return check("merge_rows", lambda rows: _plain(fn(rows)), reference_merge_rows, _take_case, cases=cases)
