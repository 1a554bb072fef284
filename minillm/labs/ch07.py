"""Checks for lab 07: one step of the continuous-batching scheduler.

The student's function gets a plain description of the engine's state; the check builds the same
state out of real Sequences, a real BlockManager and minillm's Scheduler (recompute preemption, no
prefix cache, no swapping), runs Scheduler.schedule() once, and compares which sequences run with
how many tokens, and which were preempted.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from ..engine.block_manager import BlockManager, cdiv
from ..engine.config import EngineConfig
from ..engine.scheduler import Scheduler
from ..sampling import SamplingParams
from ..sequence import Sequence, SequenceStatus
from .checker import check
from .hints import Hints


class SeqState(NamedTuple):
    """A sequence as the scheduler sees it. Lower (priority, arrival) goes first."""

    seq_id: int
    priority: int
    arrival: int
    num_tokens: int  # prompt + generated so far
    num_computed: int  # tokens whose K/V are cached (0 for a waiting sequence)
    num_blocks: int  # KV blocks it holds: cdiv(num_computed, block_size) (0 for a waiting sequence)


class _Case(tuple):
    """The arguments of one case, printed compactly (scalars first) so a failure shows all of them:
    a sequence reads `id:p<priority>,a<arrival>,<computed>/<tokens>,<blocks>b`."""

    def __repr__(self):
        running, waiting, free_blocks, bs, budget, max_num_seqs = self

        def seqs(ss):
            return "[" + " ".join(f"{s.seq_id}:p{s.priority},a{s.arrival},{s.num_computed}/{s.num_tokens},"
                                  f"{s.num_blocks}b" for s in ss) + "]"

        return (f"free_blocks={free_blocks} block_size={bs} budget={budget} max_num_seqs={max_num_seqs} "
                f"running={seqs(running)} waiting={seqs(waiting)}")


def _state(rng: random.Random):
    bs = rng.choice([1, 2, 4, 8])
    arrivals = rng.sample(range(100), rng.randint(1, 8))
    rng.shuffle(arrivals)
    n_running = rng.randint(0, len(arrivals))
    running, waiting = [], []
    for i, arrival in enumerate(arrivals):
        priority = rng.choice([0, 0, 1, 2])
        if i < n_running:
            decoding = rng.random() < 0.6  # 1 token left; else a prompt still being prefilled in chunks
            computed = rng.randint(1, 6 * bs)
            total = computed + (1 if decoding else rng.randint(2, 4 * bs))
            running.append(SeqState(i, priority, arrival, total, computed, cdiv(computed, bs)))
        else:
            waiting.append(SeqState(i, priority, arrival, rng.randint(1, 6 * bs), 0, 0))
    free_blocks = rng.randint(0 if running else 1, 3 + 2 * len(arrivals))  # a pool has at least one block
    budget = rng.randint(1, 3 * bs * len(arrivals))
    max_num_seqs = rng.randint(max(1, n_running), n_running + 3)
    return _Case((running, waiting, free_blocks, bs, budget, max_num_seqs))


def reference_schedule(running, waiting, free_blocks, block_size, budget, max_num_seqs):
    """minillm's Scheduler.schedule() on this state: (sorted [(seq_id, num_new_tokens)], sorted [preempted ids])."""
    held = sum(s.num_blocks for s in running)
    bm = BlockManager(1 + held + free_blocks, block_size)  # block 0 is reserved: exactly free_blocks stay free
    config = EngineConfig(block_size=block_size, num_gpu_blocks=bm.num_blocks, max_num_batched_tokens=budget,
                          max_num_seqs=max_num_seqs)
    sched = Scheduler(config, bm)
    for s in sorted(running + waiting, key=lambda s: s.seq_id):
        seq = Sequence(0, [7] * s.num_tokens, SamplingParams(), 0, None, [], max_len=10**6)
        seq.seq_id = s.seq_id
        sched.add(seq, s.priority, s.arrival)
        if s in running:  # as if earlier steps had computed its first num_computed tokens
            if not bm.allocate_slots(s.seq_id, s.num_computed, s.num_computed):
                raise RuntimeError("check: could not build the running state")
            sched.waiting.remove(seq)
            seq.num_computed_tokens, seq.status = s.num_computed, SequenceStatus.RUNNING
            sched.running.append(seq)
    assert bm.num_free_blocks == free_blocks
    out = sched.schedule()
    return sorted((seq.seq_id, n) for seq, n in out.scheduled), sorted(seq.seq_id for seq in out.preempted)


def check_schedule(fn, cases: int = 300):
    """fn(running, waiting, free_blocks, block_size, budget, max_num_seqs) -> (scheduled, preempted):
    scheduled [(seq_id, num_new_tokens)], preempted [seq_id] (orders do not matter); running and
    waiting are lists of SeqState."""

    def student(*state):
        out = fn(*state)
        if not (isinstance(out, tuple) and len(out) == 2):
            return out
        scheduled, preempted = out
        return sorted((int(i), int(n)) for i, n in scheduled), sorted(int(i) for i in preempted)

    return check("schedule", student, reference_schedule, _state, cases=cases)


hint = Hints("07", {
    "schedule": (
        'Two phases: first the running sequences (by priority, decodes before prompt chunks), then admit waiting ones.',
        'For each running sequence take n = min(remaining tokens, budget) and the blocks that needs; while there are not enough free blocks, preempt from the back of the queue (the lowest priority), itself last. Admit from waiting in order only if nothing was preempted, while budget, max_num_seqs and free blocks allow; stop at the first that does not fit (no overtaking).',
        'need = blocks_for(seq.num_computed + n) - seq.num_blocks\nwhile need > free_blocks:\n    victim = queue.pop() if queue else seq; free_blocks += victim.num_blocks; preempted.append(victim.seq_id)\n    if victim is seq: break',
    ),
})
