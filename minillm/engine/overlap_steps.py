"""Overlap scheduling: the host prepares step N+1 while the GPU runs step N (chapter 13).

Without it a step is a relay race with one runner at a time:

    host  | schedule  prepare  launch |                     | sample->host  outputs |
    GPU   |                           | forward pass         |                       |

and for a small model or a big batch the host's legs are as long as the GPU's. The sampled token of
step N is only needed on the host for bookkeeping (appending it, stop checks, detokenizing, outputs);
the *next step* needs it on the GPU, where it already is. So (SGLang's overlap scheduler, vLLM's async
scheduling) the engine runs, in one `step()` call:

    1. schedule and prepare step N+1, counting each sequence's token of step N as *pending*
       (Sequence.num_pending: it is in num_tokens, its id reads as -1 on the host)
    2. launch N+1: the worker fills the pending rows from step N's sampled tokens on the GPU
    3. the worker samples N+1 on the GPU without waiting (device_sampler.py) and starts copying its
       tokens to the host; they stay on the device for step N+2 (Worker.last_sampled)
    4. only now wait for step N's tokens, and do N's bookkeeping while the GPU runs N+1

so the step's outputs come one call late, and a sequence that stops at step N (EOS, a stop string)
has already been scheduled into N+1: that token is computed and thrown away (TensorRT-LLM documents
the same trade). A sequence that will certainly stop (max_tokens, the context's end) is not given the
next step at all. Blocks filled by a step are named for the prefix cache when its tokens are known,
and a stopped sequence's blocks are freed only after the step that still writes them was queued
(the GPU runs steps in order, so a later owner of a block writes after it).

Requests whose next token depends on what the host has seen (logprobs, penalties, min_tokens) and
speculative decoding use the plain step: the engine first drains the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..outputs import RequestOutput
from ..sampling.device_sampler import SampledTokens, device_samplable
from ..sequence import Sequence
from .step_input import sampling_input


@dataclass
class InflightStep:
    seqs: list[Sequence]  # row i of the sampled tokens is seqs[i]'s
    sampled: SampledTokens
    filled: list[tuple[Sequence, int, int]]  # (sequence, computed tokens before, after) for block naming
    unfinished_outputs: bool


def needs_host_sampling(params) -> bool:
    """A request the overlapped step cannot serve, for its whole life (see the module docstring)."""
    # (a grammar's next mask needs the token just sampled: engine/structured_output.py)
    return not device_samplable(params, 0) or params.structured_outputs is not None


class OverlapSteps:
    """A mixin of LLMEngine: the overlapped step and the processing of the step in flight."""

    _inflight: InflightStep | None = None

    def _can_overlap(self) -> bool:
        return self.async_scheduling and not self.has_proposer and not self._host_sampled

    def _step_overlapped(self, unfinished_outputs: bool) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        prev = self._inflight
        self._move_blocks(sched)
        kv_failed = self._kv_failed(sched)  # chapter 17: remote K/V that never came
        if sched.is_empty:
            return kv_failed + self._drain()
        logits_indices, samplers = self._logits_rows(sched)
        try:
            step = self._prepare(sched, logits_indices)
            seqs, rows = self._sampling_order(sched, samplers)
            # sampled on the device, each row's RNG counter counting its pending tokens too
            step.sampling = sampling_input(seqs, rows, on_device=True) if seqs else None
            out = self.executor.execute_model(step)
            if out.kv_stats is not None:
                self.engine_stats.kv.add(out.kv_stats)
            filled = self._count_computed(sched)
            if samplers and not sched.decode_only:
                self._join_forks(samplers)
            inflight = InflightStep(seqs, out.pending, filled, unfinished_outputs) if seqs else None
        except Exception as e:  # the forward pass (or its sampling) concerns every scheduled request
            failed = self._fail({self._group_of[s.seq_id]: e for s, _ in sched.scheduled if s.seq_id in self._group_of})
            return kv_failed + self._drain() + failed
        for row, seq in enumerate(seqs):
            # the token is on its way; a sequence that this token certainly ends gets no further step
            p = seq.params
            last = (seq.num_tokens + 1 >= self.max_model_len
                    or (p.max_tokens is not None and len(seq.output_ids) + seq.num_pending + 1 >= p.max_tokens))
            if not last:
                seq.add_pending(row)
        if inflight is None:  # only prompt chunks ran: name their blocks now, nothing to sample
            self._name_blocks(filled)
        outputs = self._process(prev) if prev is not None else []
        self._inflight = inflight
        return kv_failed + outputs

    def _count_computed(self, sched) -> list[tuple[Sequence, int, int]]:
        """_advance's counting, without naming blocks (their tokens may still be on the GPU)."""
        filled = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + n) for seq, n in sched.scheduled]
        self._advance(sched, name_blocks=False)
        return filled

    def _name_blocks(self, filled: list[tuple[Sequence, int, int]]) -> None:
        bs = self.block_manager.block_size
        for seq, before, after in filled:
            if before // bs != after // bs and seq.seq_id in self.block_manager.block_tables:
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, after, seq.lora_int_id)

    def _drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any: -> its outputs."""
        prev, self._inflight = self._inflight, None
        return self._process(prev) if prev is not None else []

    def _process(self, step: InflightStep) -> list[RequestOutput]:
        """Step N's bookkeeping, once its tokens reach the host (the GPU meanwhile runs step N+1)."""
        tokens = step.sampled.tolist()
        self._name_blocks(step.filled)  # every token these blocks hold is known now
        live, errors = [], {}
        for seq, token in zip(step.seqs, tokens):
            seq.take_pending()
            group = self._group_of.get(seq.seq_id)
            if group is None or seq.finished:  # aborted, failed, or stopped by its previous token
                continue
            if token < 0:
                errors[group] = ValueError("Sampler: the logits have no finite value for an allowed token (all NaN "
                                           "or -inf): the model's output is broken, there is no token to pick")
                continue
            seq.append(token)
            if seq.finished:
                seq.drop_pending()  # a token sampled after this one is thrown away
            live.append(seq)
        self.engine_stats.num_generation_tokens += len(live)
        failed = self._fail(errors) if errors else []
        return failed + self._outputs([s for s in live if s.seq_id in self._group_of], step.unfinished_outputs)
