"""The engine's steps for speculative decoding (chapter 09), apart from the step they fit into.

LLMEngine.step (llm_engine.py) runs schedule -> execute -> advance -> sample -> outputs. With a
speculative_config, three pieces join it, all here:

    lookahead   the scheduler asks, per running sequence, how many draft slots to reserve
                (`_num_lookahead`: k, or 0 above disable_by_batch_size, near max_tokens or the context's
                end, and for requests whose distribution depends on the tokens just accepted; with
                adaptive, the k the batch size and the measured acceptance call for, `_step_k`);
    propose     after the step's block copies, the proposer fills the reserved slots (`_propose`);
    verify      the worker verifies the rows of a sequence with drafts (worker/sample_step.py: the
                rejection sampler, or its greedy rule on the host when the whole batch is greedy); the
                emitted tokens are appended one by one and the rest rolled back (`_append_verified`,
                `_rollback`).

A mixin of LLMEngine: it reads the engine's spec_config, executor, block_manager, engine_stats and
request bookkeeping.
"""

from __future__ import annotations

from ..outputs import RequestOutput
from ..sequence import Sequence
from ..spec_decode.adaptive import AdaptiveK
from .scheduler import SchedulerOutput


class SpecDecodeSteps:
    def _num_lookahead(self, seq: Sequence, batch_size: int) -> int:
        """Draft tokens seq may carry this step: k (0 when the batch is too large, see
        SpeculativeConfig.disable_by_batch_size), fewer near max_tokens or the context's end (a step
        emits at most k + 1 tokens), none when its distribution depends on the tokens accepted, or
        while its drafting is paused (SpeculativeConfig.min_acceptance_rate, `_back_off`)."""
        k, p = self._step_k(batch_size), seq.params
        if k == 0 or p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty \
                or p.frequency_penalty or len(seq.output_ids) < max(p.min_tokens, seq.spec_resume_at) \
                or p.structured_outputs is not None:  # (a grammar's drafts: not yet, structured_output.py)
            return 0
        left = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - len(seq.output_ids) - 1)
        return max(0, min(k, left))

    def _step_k(self, batch_size: int) -> int:
        spec = self.spec_config
        k = spec.speculative_tokens(batch_size)
        if not spec.adaptive or k == 0:
            return k
        if self.__dict__.get("adaptive_k") is None:  # made at the first step (the mixin has no __init__)
            self.adaptive_k = AdaptiveK.from_config(spec)
        return min(k, self.adaptive_k.k(batch_size))

    def _propose(self, sched: SchedulerOutput) -> tuple[list[RequestOutput], list[Sequence]]:
        """Fill the slots the scheduler reserved with draft tokens; -> (outputs of requests whose drafting
        failed, the sequences that had slots reserved)."""
        want = [(i, s, n - 1) for i, (s, n) in enumerate(sched.scheduled) if n > s.num_tokens - s.num_computed_tokens]
        if not want:
            return [], []
        seqs = [s for _, s, _ in want]
        try:
            drafts, probs = self.executor.propose(seqs, [k for *_, k in want], self.block_manager.peek_table_changes())
        except Exception as e:  # a broken draft concerns the sequences it drafted for
            failed = self._fail({self._group_of[s.seq_id]: e for s in seqs})
            sched.scheduled = [(s, n) for s, n in sched.scheduled if s.seq_id in self._group_of]
            return failed, []
        d = 0
        for (i, seq, _), draft in zip(want, drafts):
            seq.spec_token_ids = draft
            seq.spec_probs = probs[d : d + len(draft)] if probs is not None else None
            d += len(draft)
            sched.scheduled[i] = (seq, 1 + len(draft))
        return [], seqs

    def _append_verified(self, seq: Sequence, tokens: list[int]) -> None:
        """A verify's emitted tokens (the worker's rejection sampler: accepted drafts, then one more)
        appended one by one, its metrics recorded, its drafts rolled back."""
        k = len(seq.spec_token_ids)
        seq.spec.record(k, len(tokens) - 1)
        self.engine_stats.spec.record(k, len(tokens) - 1)
        self._back_off(seq, k, len(tokens) - 1)
        if self.spec_config.adaptive and k:
            self.adaptive_k.observe(k, len(tokens) - 1)
        for t in tokens:  # one by one: EOS, a stop string or max_tokens may end it inside the run
            seq.append(t)
            self.engine_stats.num_generation_tokens += 1
            if seq.finished:
                break
        self._rollback(seq, len(tokens) - 1)

    def _back_off(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """min_acceptance_rate: a sequence whose running acceptance rate falls below it pauses drafting,
        8 output tokens the first time, twice as long each time in a row (at most 128); the verify after
        a pause starts the average at the floor, so that one step decides again."""
        floor = self.spec_config.min_acceptance_rate
        if floor is None:
            return
        seq.spec_recent_rate = 0.5 * seq.spec_recent_rate + 0.5 * accepted / drafted
        if seq.spec_recent_rate >= floor:
            seq.spec_pause = 0
            return
        seq.spec_pause = min(2 * seq.spec_pause or 8, 128)
        seq.spec_resume_at = len(seq.output_ids) + seq.spec_pause
        seq.spec_recent_rate = floor

    def _rollback(self, seq: Sequence, accepted: int) -> None:
        """After a verify: the K/V of the last token and the accepted drafts stand; the rest is past
        num_computed_tokens (overwritten when the sequence gets there)."""
        before = seq.num_computed_tokens - 1 - len(seq.spec_token_ids)  # computed when the step began
        seq.spec_token_ids, seq.spec_probs = [], None
        if seq.finished:
            return
        seq.num_computed_tokens = seq.num_tokens - 1  # = before + 1 + accepted
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        bs = self.block_manager.block_size
        self.block_manager.trim(seq.seq_id, seq.num_tokens)
        if before // bs != seq.num_computed_tokens // bs:  # accepted tokens filled a block: name it now
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                                 seq.lora_int_id)
