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

A request with a grammar (chapter 14) keeps the overlap: its mask for step N+1 needs its token of
step N, so a step with a grammar splits point 3 in two (vLLM's execute_model / sample_tokens):

    2'. launch N+1's forward pass alone (the worker keeps its logits on the device)
    3'. wait for step N's tokens (they were sampled before N+1's forward pass, so they come first),
        feed them to the matchers, fill N+1's bitmask, then launch N+1's masked sampling

The GPU runs N+1's forward pass while the host waits and fills; it waits for the host only if the
fill outlasts the forward pass (chapters/bench/structured-overlap-design.md).

Requests whose next token depends on what the host has seen (logprobs, penalties, min_tokens) and
speculative decoding use the plain step: the engine first drains the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    tokens: list[int] | None = None  # once read on the host (and fed to the grammars: accept_grammars)
    errors: dict[int, Exception] = field(default_factory=dict)  # seq_id -> a token its grammar refused


def needs_host_sampling(params) -> bool:
    """A request the overlapped step cannot serve, for its whole life (see the module docstring)."""
    return not device_samplable(params, 0)


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
            grammar = self.structured.any_structured(seqs)  # its mask waits for step N's tokens (3')
            step.sampling = sampling_input(seqs, rows, on_device=True, defer_bitmask=grammar) if seqs else None
            out = self.executor.execute_model(step)  # queued; with a grammar, the forward pass alone
            if grammar:  # while the GPU runs it: step N's tokens into the grammars, N+1's mask, its sampling
                self.accept_grammars(prev)
                out = self.executor.sample_tokens(self.structured.bitmask(seqs))
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

    def accept_grammars(self, step: InflightStep | None) -> None:
        """Read step N's tokens (waiting for their copy, not for the work queued after it) and feed each
        to its sequence's grammar, once; a token a grammar refuses fails its request in _process."""
        if step is None or step.tokens is not None:
            return
        step.tokens = step.sampled.tolist()
        for seq, token in zip(step.seqs, step.tokens):
            if token < 0 or seq.finished or seq.seq_id not in self._group_of:  # as _process skips them
                continue
            try:
                self.structured.accept(seq.seq_id, token)  # a dict lookup for a free sequence
            except ValueError as e:
                step.errors[seq.seq_id] = e

    def _process(self, step: InflightStep) -> list[RequestOutput]:
        """Step N's bookkeeping, once its tokens reach the host (the GPU meanwhile runs step N+1)."""
        self.accept_grammars(step)  # (done already when step N+1 had a grammar)
        tokens = step.tokens
        self._name_blocks(step.filled)  # every token these blocks hold is known now
        live, errors = [], {}
        for seq, token in zip(step.seqs, tokens):
            seq.take_pending()
            group = self._group_of.get(seq.seq_id)
            if group is None or seq.finished:  # aborted, failed, or stopped by its previous token
                continue
            if seq.seq_id in step.errors:
                errors[group] = step.errors[seq.seq_id]
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
