# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 07 · One step of the scheduler
#
# Continuous batching decides again at every step who runs: a sequence that finished leaves at once,
# and a waiting one takes its place the next step instead of when the whole batch is done (Orca, Yu et
# al., 2022). Write that decision — one call of minillm's `Scheduler.schedule()`
# (`minillm/engine/scheduler.py`), without swapping and prefix caching. The check builds the same
# state out of real `Sequence`s, a real `BlockManager` and the real `Scheduler`, runs one step, and
# compares.

# %%
from minillm.labs import ch07
from minillm.labs.ch07 import SeqState

SeqState(seq_id=3, priority=0, arrival=17, num_tokens=40, num_computed=39, num_blocks=3)  # a decoding sequence


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch07.hint("schedule", 1)`, then 2, then 3. This lists the exercises:

# %%
ch07.hint()

# %% [markdown]
# ## Exercise — `schedule`
#
# Every sequence is a `SeqState`: `num_tokens` (prompt and generated so far), `num_computed` (those
# whose K/V are cached) and `num_blocks` (the KV blocks it holds, $\lceil \text{num_computed} /
# \text{block_size} \rceil$). A waiting sequence goes before another when its `(priority, arrival)`
# is smaller; running ones are ordered by `(priority, prefilling, arrival)`: within a priority,
# sequences that are decoding (exactly one token left) go before those still prefilling their prompt,
# so a long prompt never delays the next token of a sequence already generating (Sarathi-Serve).
# To run $n$ more tokens a sequence needs
# $\lceil (\text{num_computed} + n) / \text{block_size} \rceil - \text{num_blocks}$ more blocks.
# The step may run at most `budget` tokens in all.
#
# 1. **Running** sequences, in order: each gets $n = \min(\text{tokens left}, \text{budget left})$
#    tokens — 1 when decoding, a chunk of its prompt when prefilling (chunked prefill). With no budget
#    left it gets nothing this step but stays running. If the free blocks are too few, **preempt** the
#    lowest-ordered running sequence not yet handled this step (the last in the order), and if there
#    is none, the sequence itself; a preempted sequence gives all its blocks back (it will recompute
#    them later) and is not scheduled. Repeat until it fits or it preempted itself.
# 2. **Waiting** sequences, only if nobody was preempted this step, in order, first come first served:
#    stop at the first one that does not fit — when the budget is spent, when `max_num_seqs` sequences
#    are running (those still running from step 1 count), or when its blocks are not free. An admitted
#    sequence gets $\min(\text{num_tokens}, \text{budget left})$ tokens.
#
# Return `(scheduled, preempted)`: a list of `(seq_id, n)` and a list of `seq_id`s. A failing case
# prints each sequence as `id:p<priority>,a<arrival>,<num_computed>/<num_tokens>,<num_blocks>b`.

# %%
def schedule(running, waiting, free_blocks, block_size, budget, max_num_seqs):
    ### BEGIN SOLUTION
    def blocks_for(num_tokens):
        return -(-num_tokens // block_size)

    def order(s):
        return s.priority, s.arrival

    def running_order(s):
        return s.priority, s.num_tokens - s.num_computed > 1, s.arrival  # decodes before prompt chunks

    queue = sorted(running, key=running_order)
    scheduled, preempted, num_running = [], [], 0
    while queue:
        seq = queue.pop(0)
        n = min(seq.num_tokens - seq.num_computed, budget)
        if n > 0:
            need = blocks_for(seq.num_computed + n) - seq.num_blocks
            while need > free_blocks:
                victim = queue.pop() if queue else seq  # the lowest priority goes first, itself last
                free_blocks += victim.num_blocks
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.seq_id in preempted:
                continue
            free_blocks -= need
            scheduled.append((seq.seq_id, n))
            budget -= n
        num_running += 1
    if not preempted:  # no admissions in a step that had to preempt
        for seq in sorted(waiting, key=order):
            if budget == 0 or num_running >= max_num_seqs:
                break
            n = min(seq.num_tokens, budget)
            if blocks_for(n) > free_blocks:
                break  # FCFS: nobody overtakes the head of the queue
            free_blocks -= blocks_for(n)
            budget -= n
            num_running += 1
            scheduled.append((seq.seq_id, n))
    return scheduled, preempted
    ### END SOLUTION


# %% tags=["check"]
ch07.check_schedule(schedule)

# %% [markdown]
# ## What you built
#
# This is `Scheduler.schedule()` with the engine's extras taken out. The real one also brings swapped
# sequences back before admitting new ones (preemption by swapping, `preemption_mode="swap"`), lets a
# prefix-cache hit skip the cached part of a prompt, and hands back the copy-on-write copies of the
# step. The `LLMEngine` calls it every step, runs the model on what it returns (`ModelRunner`), appends
# one sampled token to every sequence whose prompt is now complete, and calls `finish` on those that
# stopped — so their blocks serve someone else at the next step.
