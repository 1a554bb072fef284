"""The scheduler's waiting queue at scale (issue 30): removal is O(1) and admission O(log n), so a
burst of aborts of 20,000 queued requests in arbitrary order takes well under the couple of seconds
a step may wait (a scan per removal took 34 s), and the queue still admits in (priority, arrival)
order, checked against a plain sorted list under random pushes, removals and re-queues."""

from __future__ import annotations

import random
import time

from minillm import SamplingParams
from minillm.engine import EngineConfig
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import Scheduler
from minillm.engine.waiting_queue import WaitingQueue
from minillm.sequence import Sequence


def _seq(seq_id: int, n: int = 4) -> Sequence:
    seq = Sequence(0, [7] * n, SamplingParams(), 0, None, [], max_len=10**6)
    seq.seq_id = seq_id
    return seq


def test_waiting_queue_matches_a_sorted_list(seed):
    rng = random.Random(seed)
    keys, queue, ref = {}, None, []
    queue = WaitingQueue(lambda s: keys[s.seq_id])
    seqs = {}
    for step in range(4000):
        op = rng.random()
        if op < 0.45 or not ref:  # a new sequence, or one queued again (a preempted one goes back)
            sid = rng.randrange(600)
            seq = seqs.setdefault(sid, _seq(sid))
            if seq in queue:
                continue
            keys[sid] = (rng.randrange(3), step, sid)
            queue.append(seq)
            ref.append(seq)
        elif op < 0.8:  # an abort, anywhere in the queue
            seq = rng.choice(ref)
            ref.remove(seq)
            assert queue.discard(seq)
            assert not queue.discard(seq)  # twice is a no-op
        else:  # admission: the first in (priority, arrival) order
            ref.sort(key=lambda s: keys[s.seq_id])
            assert queue.peek() is ref[0]
            assert queue.popleft() is ref.pop(0)
        assert len(queue) == len(ref) and bool(queue) == bool(ref)
    assert list(queue) == sorted(ref, key=lambda s: keys[s.seq_id])
    assert len(queue._heap) <= 2 * len(ref) + 65  # stale entries are compacted away


def test_abort_burst_of_20k_waiting_is_fast(seed):
    bm = BlockManager(64, 16)
    sched = Scheduler(EngineConfig(block_size=16, num_gpu_blocks=64), bm)
    seqs = [_seq(i + 1) for i in range(20_000)]
    for i, seq in enumerate(seqs):
        sched.add(seq, 0, i)
    sched.schedule()  # a few are admitted and run; the rest wait
    running = list(sched.running)
    assert running and len(sched.waiting) == len(seqs) - len(running)
    order = seqs[:]
    random.Random(seed).shuffle(order)  # a set of ids: arbitrary order, not arrival order
    t0 = time.perf_counter()
    for seq in order:
        sched.abort(seq)
    took = time.perf_counter() - t0
    assert took < 2.0, f"aborting 20,000 queued sequences took {took:.1f} s"
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks - 1
    assert all(s.finish_reason == "abort" for s in seqs)


def test_admission_after_aborts_keeps_priority_then_arrival_order(seed):
    rng = random.Random(seed)
    bm = BlockManager(4096, 16)
    sched = Scheduler(EngineConfig(block_size=16, num_gpu_blocks=4096, max_num_seqs=10**4,
                                   max_num_batched_tokens=10**6), bm)
    seqs = [_seq(i + 1) for i in range(3000)]
    prio = {s.seq_id: rng.randrange(4) for s in seqs}
    for i, seq in enumerate(seqs):
        sched.add(seq, prio[seq.seq_id], i)
    gone = set(rng.sample(range(len(seqs)), 2000))
    for i in gone:
        sched.abort(seqs[i])
    out = sched.schedule()
    want = sorted((s for i, s in enumerate(seqs) if i not in gone), key=lambda s: (prio[s.seq_id], s.seq_id))
    assert [s for s, _ in out.scheduled] == want
