"""The Scheduler: every step, decide which sequences run and how many of their tokens (chapter 07).

Static batching runs a batch until its longest member finishes; the slots of the short ones idle.
Continuous batching (Orca's iteration-level scheduling) decides again at every step:

    1. running sequences, highest priority first (and within a priority, decodes before prompt
       chunks): each gets its next tokens (1 when decoding, a chunk of its prompt while prefilling),
       while the step's token budget lasts. If the pool has
       no block for one, the lowest-priority running sequence is preempted (possibly itself):
         recompute - its blocks are freed and it goes back to waiting, to be prefilled again
         swap      - its blocks are copied to CPU memory and it waits in `swapped`
    2. if nobody was preempted: swapped sequences come back, then waiting ones are admitted
       (a prefix-cache hit skips their cached tokens), while the budget, the block pool and
       max_num_seqs allow. A prompt longer than what is left of the budget is cut: chunked prefill,
       so one long prompt never stalls everybody's decode.

Speculative decoding (chapter 09): `num_lookahead(seq, batch_size)` (set by the engine) says how many
draft tokens a decoding sequence may carry this step; the scheduler reserves their token budget and KV
slots with its own (1 + k tokens), or runs it without drafts when the pool cannot hold them.

Multi-LoRA (chapter 16, EngineConfig.enable_lora): the running sequences never use more than
max_loras distinct adapters (the GPU slots). A swapped or waiting sequence whose adapter is not among
them joins only while a slot is left; otherwise it waits, and the waiting sequences behind it that
need no adapter (at most max_num_seqs looked at) may go first. Those with an adapter wait too, even
one that runs: else a busy adapter's stream of new requests would keep its slot, and the passed-over
request its wait, forever.

Order is (priority, arrival): lower priority values go first, then first come, first served.
Finished sequences leave at once (`finish`), so their blocks serve someone else the next step.
The waiting queue is a heap with O(1) removal (waiting_queue.py): admitting, finishing and aborting
cost O(log n) whatever the queue's length, so a burst of aborts never stalls the next step.

The offload tier (chapter 15, kv_offload.py): admission looks up the prompt's blocks after its GPU
prefix hits in the CPU pool too; those blocks are allocated with the rest, copied back before the
step's forward pass (SchedulerOutput.offload_load), and counted as computed, like GPU hits.

Disaggregated serving (chapter 17, a KV connector): admission asks the connector how many prompt
tokens beyond the local prefix-cache hits another engine computed; those are allocated with the rest
and loaded by the worker in the step's forward pass, layer by layer, and only the prompt's last token
is computed here. A request whose remote K/V is not there yet waits in `waiting_for_remote_kvs`
(WAITING_FOR_REMOTE_KVS) and is asked about again each step, until it comes or kv_load_timeout ends the
wait (kv_load_failure_policy: the request fails, or is prefilled here). A finished request whose
blocks the connector still sends (a pull transport) keeps them in `sending` until the connector says
they went, or timed out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..distributed.kv_transfer import KVConnectorBase, KVConnectorMetadata, KVTransferError
from ..sequence import Sequence, SequenceStatus
from .block_manager import BlockManager
from .config import EngineConfig
from .waiting_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to run now)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    preempted: list[Sequence] = field(default_factory=list)
    # every scheduled sequence runs exactly its one last token: no prompt chunk, no drafts, no forks to
    # join, nobody admitted or swapped in (chapter 13: the engine's per-step work has a short path then)
    decode_only: bool = False
    kv_connector_metadata: KVConnectorMetadata | None = None  # chapter 17: the step's loads and saves
    kv_failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # remote K/V that never came
    # chapter 15's offload tier (kv_offload.py): evicted blocks to copy out, CPU slots to copy back in
    offload_save: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu slot)
    offload_load: list[tuple[int, int]] = field(default_factory=list)  # (cpu slot, gpu)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, connector: KVConnectorBase | None = None):
        self.config, self.bm = config, block_manager
        self.connector = connector  # chapter 17: the scheduler side of a KV connector, or None
        self.waiting_for_remote_kvs: list[Sequence] = []
        self.sending: dict[int, Sequence] = {}  # seq_id -> a finished sequence whose blocks are still sent
        self.waiting = WaitingQueue(self._key)  # (priority, arrival) order; O(log n) in, O(1) out
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.stats = block_manager.stats  # counts num_preemptions
        self._order: dict[int, tuple] = {}  # seq_id -> (priority, arrival, seq_id)
        # seq_id -> how many sequences it becomes when its prompt is done (n > 1: the forks of parallel
        # sampling). Admission counts them against max_num_seqs up front, so the forks always fit.
        self._fanout: dict[int, int] = {}
        self.num_lookahead = None  # (seq, running batch size) -> draft tokens it may carry; None: no drafts
        # running is already in schedule order: everyone in it decoded last step and nobody joined since.
        # A decoding sequence keeps decoding (one token to go after every step) until it leaves, so the
        # sort below would not move anyone: at batch 256 skipping it saves the key of every sequence.
        self._in_order = False

    def add(self, seq: Sequence, priority: int, arrival: int, fanout: int = 1) -> None:
        self._order[seq.seq_id] = (priority, arrival, seq.seq_id)
        if fanout > 1:
            self._fanout[seq.seq_id] = fanout
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, like: Sequence) -> None:
        """A forked sequence joins the running queue in its parent's place in the order."""
        self._order[seq.seq_id] = self._order[like.seq_id][:2] + (seq.seq_id,)
        self._fanout.pop(like.seq_id, None)  # the parent has forked: from now on it is one sequence
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._in_order = False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.waiting_for_remote_kvs or self.sending)

    @property
    def only_transfers(self) -> bool:
        """Nothing to compute, only remote K/V to wait for or blocks being sent (the engine naps)."""
        return not (self.waiting or self.running or self.swapped)

    def _key(self, seq: Sequence) -> tuple:
        return self._order[seq.seq_id]

    def _seats(self, seq: Sequence) -> int:
        """Sequences seq will be once its prompt is done: itself and its forks."""
        return self._fanout.get(seq.seq_id, 1)

    def _free_seats(self) -> int:
        """What max_num_seqs leaves beside everyone running, counting the forks still to come."""
        used = len(self.running)
        if self._fanout:  # parents still prefilling: their forks are on the way
            used += sum(self._seats(s) - 1 for s in self.running)
        return self.config.max_num_seqs - used

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.connector is not None:
            self._poll_transfers(out)
        budget = self.config.max_num_batched_tokens
        # Within a priority, decodes before prompt chunks (Sarathi-Serve): a long prompt never delays
        # the next token of a sequence already generating.
        order = self._order
        if self._in_order:
            queue = deque(self.running)
        else:
            queue = deque(sorted(self.running, key=lambda s: (order[s.seq_id][0], s.num_tokens - s.num_computed_tokens > 1,
                                                              order[s.seq_id][1:])))
        self.running = []
        lookahead, batch = self.num_lookahead, len(queue)
        all_one, decodes = True, 0  # everyone had one token to go; sequences scheduled with just that token
        while queue:
            seq = queue.popleft()
            todo = seq.num_tokens - seq.num_computed_tokens
            n = min(todo, budget)
            all_one = all_one and todo == 1
            # one token to go (a prompt's last one too), and no forks waiting for this step's logits
            decoding = todo == 1 and seq.seq_id not in self._fanout
            k = min(lookahead(seq, batch), budget - 1) if lookahead is not None and decoding else 0
            if k > 0 and self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1 + k, 1 + k):
                out.scheduled.append((seq, 1 + k))  # the last token and k drafts, proposed after scheduling
                budget -= 1 + k
            elif n > 0:
                while not self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + n, n):
                    victim = queue.pop() if queue else seq  # lowest priority first; itself last
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                out.scheduled.append((seq, n))
                budget -= n
                decodes += decoding
            self.running.append(seq)
        kept = len(self.running)
        if not out.preempted:  # vLLM's rule: no admissions in a step that had to preempt
            budget = self._swap_in(out, budget)
            self._admit(out, budget)
        out.decode_only = decodes == len(out.scheduled)  # (an admission or a swap-in is not a decode)
        # everyone decodes, nobody joined (admitted, swapped in) and nobody was preempted: the order stands
        self._in_order = all_one and not out.preempted and len(self.running) == kept
        out.blocks_to_copy, self.bm.pending_copies = self.bm.pending_copies, []
        if self.bm.offload is not None:
            out.offload_save, out.offload_load = self.bm.offload.take()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out.scheduled, self.bm.block_tables)
        return out

    # ---- chapter 17: remote K/V --------------------------------------------------------------------

    def _poll_transfers(self, out: SchedulerOutput) -> None:
        """Free the blocks whose sending ended; move sequences whose remote K/V arrived back to waiting."""
        for seq_id in self.connector.get_finished():
            if self.sending.pop(seq_id, None) is not None:
                self.bm.free(seq_id)
        still = []
        for seq in self.waiting_for_remote_kvs:
            try:
                ready = self.connector.get_num_new_matched_tokens(seq, 0) is not None
            except KVTransferError as e:
                ready = self._load_failed(seq, e, out)
            if ready:  # admitted in its (priority, arrival) place, as if it had waited there
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)
            elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
                still.append(seq)
        self.waiting_for_remote_kvs = still

    def _load_failed(self, seq: Sequence, error: Exception, out: SchedulerOutput) -> bool:
        """kv_load_failure_policy: "recompute" -> True (prefill it here); "fail" -> False, the engine ends it."""
        if self.connector.config.kv_load_failure_policy == "recompute":
            self.connector.forget(seq)
            return True
        seq.status = SequenceStatus.FINISHED  # out of every queue; the engine reports the error
        out.kv_failed.append((seq, error))
        return False

    def _remote_tokens(self, seq: Sequence, computed: int, out: SchedulerOutput) -> int | None:
        """Prompt tokens after `computed` to load from the remote side; None: the sequence left waiting."""
        try:
            n = self.connector.get_num_new_matched_tokens(seq, computed)
        except KVTransferError as e:
            self.waiting.popleft()
            if self._load_failed(seq, e, out):
                self.waiting.append(seq)  # (forgotten by the connector: admitted as a local prefill)
            return None
        if n is None:  # not there yet: it waits aside, and the queue moves on
            self.waiting.popleft()
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote_kvs.append(seq)
        return n
    def _adapters(self) -> set[int] | None:
        """The adapters the running sequences use (None: LoRA is off, no limit)."""
        if not self.config.enable_lora:
            return None
        return {s.lora_int_id for s in self.running if s.lora_int_id}

    def _adapter_fits(self, seq: Sequence, adapters: set[int] | None) -> bool:
        """Whether seq may run beside them without a (max_loras + 1)-th adapter; counts it in if so."""
        if adapters is None or not seq.lora_int_id or seq.lora_int_id in adapters:
            return True
        if len(adapters) >= self.config.max_loras:
            return False
        adapters.add(seq.lora_int_id)
        return True

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=self._key)
        seats = self._free_seats()  # once per pass, then kept up to date (not a scan per candidate)
        adapters = self._adapters()
        while self.swapped and budget > 0 and self._seats(self.swapped[0]) <= seats:
            seq = self.swapped[0]
            if adapters is not None and not self._adapter_fits(seq, set(adapters)):
                break  # its adapter needs a slot the running ones hold: it comes back when one frees
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # its blocks come back, plus any the next n tokens start (exactly: a spare block would make a
            # sequence that needs the whole pool wait forever once everyone else is swapped out too)
            need = max(len(self.bm.cpu_tables[seq.seq_id]), self.bm.blocks_needed(seq.num_computed_tokens + n))
            if need > self.bm.num_free_blocks:
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += self.bm.swap_in(seq.seq_id)
            if not self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + n, n):
                raise RuntimeError("swap-in: blocks counted free were not")  # cannot happen: checked above
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if adapters is not None:
                self._adapter_fits(seq, adapters)
            seats -= self._seats(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        seats = self._free_seats()
        adapters, passed = self._adapters(), []  # passed: waiting sequences whose adapter has no slot now
        while self.waiting and budget > 0 and self._seats(self.waiting.peek()) <= seats:
            seq = self.waiting.peek()
            if adapters is not None and seq.lora_int_id and (passed or not self._adapter_fits(seq, set(adapters))):
                if len(passed) >= self.config.max_num_seqs:
                    break
                passed.append(self.waiting.popleft())  # back in its place below: its key is unchanged
                continue
            hits = self.bm.match_prefix(seq.token_ids, seq.lora_int_id)
            offloaded = self.bm.match_offloaded(seq.token_ids, len(hits), seq.lora_int_id)  # CPU hits after them
            computed = (len(hits) + len(offloaded)) * self.bm.block_size
            remote = 0
            if self.connector is not None and (remote := self._remote_tokens(seq, computed, out)) is None:
                continue
            n = min(seq.num_tokens - computed - remote, budget)
            if not self.bm.allocate_slots(seq.seq_id, computed + remote + n, remote + n, hits):
                break  # the pool is full: wait for blocks (FCFS: nobody overtakes the head)
            self.waiting.popleft()
            self.bm.count_prefix_hits(seq.token_ids, len(hits))
            self.bm.restore_offloaded(seq.seq_id, seq.token_ids, len(hits), offloaded, seq.lora_int_id)
            seq.num_computed_tokens = computed
            if remote:  # loaded in this step's forward pass, before the layers attend
                self.connector.update_state_after_alloc(seq, self.bm.block_tables[seq.seq_id], remote)
                seq.num_computed_tokens += remote
            seq.num_draft_computed = 0  # prefix hits hold the target's K/V, not a draft model's
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if adapters is not None:
                self._adapter_fits(seq, adapters)
            seats -= self._seats(seq)
            out.scheduled.append((seq, n))
            budget -= n
        for seq in passed:
            self.waiting.append(seq)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.stats.num_preemptions += 1
        out.preempted.append(seq)
        seq.num_draft_computed = 0  # a draft model's pool is neither swapped nor kept: it drafts from scratch
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq.seq_id):
            out.blocks_to_swap_out += self.bm.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.bm.free(seq.seq_id)  # recompute: the K/V will be computed again from the tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # ---- leaving ---------------------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        self._remove(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, seq: Sequence) -> None:
        self._remove(seq)
        if seq.status is not SequenceStatus.FINISHED:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"

    def _remove(self, seq: Sequence) -> None:
        # O(1) for a waiting sequence, whatever the queue's length; running holds at most max_num_seqs,
        # and only a sequence whose status says so is looked for in running or swapped
        if not self.waiting.discard(seq):
            if seq.status is SequenceStatus.RUNNING and seq in self.running:
                self.running.remove(seq)
            elif seq.status is SequenceStatus.SWAPPED and seq in self.swapped:
                self.swapped.remove(seq)
            elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and seq in self.waiting_for_remote_kvs:
                self.waiting_for_remote_kvs.remove(seq)
        if self.connector is not None:
            delay, seq.kv_transfer_params = self.connector.request_finished(seq, self.bm.block_tables.get(seq.seq_id, []))
            if delay:  # a pull transport reads these blocks after the request ended: freed when it says so
                self.sending[seq.seq_id] = seq
                self._order.pop(seq.seq_id, None)
                self._fanout.pop(seq.seq_id, None)
                return
        self.bm.free(seq.seq_id)
        self._order.pop(seq.seq_id, None)
        self._fanout.pop(seq.seq_id, None)
