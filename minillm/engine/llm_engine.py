"""LLMEngine: requests in, tokens out, many requests at once (chapter 07).

    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one scheduler step: every running sequence advances
            print(out.request_id, out.outputs[0].text, out.finished)

One step is five stages, each a method below:

    schedule  Scheduler.schedule: who runs, how many tokens each, which blocks move
    execute   the executor (chapter 13): block copies, then the step packed as a ModelInput
              (step_input.py) and run by the worker, which samples the rows in logits_indices (the
              last token of each sequence whose computed tokens reach its end), each with its own
              parameters and seed, and answers with tokens (worker/sample_step.py)
    advance   bookkeeping: computed tokens, full blocks named for the prefix cache, forks joined
    append    the tokens appended to their sequences, stop checks
    outputs   finished sequences leave and free their blocks; RequestOutputs for the caller

A request with n > 1 prefills its prompt once: its first sequence runs alone until the prompt is
computed, then the other n - 1 fork its blocks (BlockManager.fork) and sample their first token
from the same row of logits, each with its own seed. A request that can never fit (its prompt plus
max_tokens beyond the context or the whole block pool) is refused in add_request; everything else
is served, under memory pressure by preemption. A step that fails (the model raises, or one
request's sampling does) ends only the requests it concerns, with finish_reason "error", and the
engine goes on serving the others.

Speculative decoding (chapter 09, EngineConfig.speculative_config): the scheduler reserves up to k
extra tokens for each decoding sequence; after the block copies, the proposer fills them with draft
tokens; the step computes the last token and the drafts together, with logits at all
k + 1 rows; the worker's rejection sampler keeps a prefix of the drafts plus one token, appended one by
one with the stop checks; then the rollback sets num_computed_tokens to the accepted tokens
(the rejected slots are overwritten later), gives back blocks past the sequence's end, and names the
newly full, accepted blocks for the prefix cache. Requests whose next-token distribution depends on
the tokens just accepted (penalties, logprobs, before min_tokens) get no drafts. Those steps live in
spec_decode_steps.py.

Disaggregated prefill and decode (chapter 17, EngineConfig.kv_transfer_config): the engine holds the
scheduler side of a KV connector (distributed/kv_transfer/), the worker the other; each step's loads
and saves travel in the ModelInput, and the bytes moved come back in the worker's answer
(engine.stats: kv_bytes_saved, kv_save_gb_per_s, ...), with or without overlap scheduling.

Multi-LoRA (chapter 16, EngineConfig.enable_lora): a request may carry a LoRARequest. Its adapter is
read and checked when the request is added (lora/manager.py keeps it on the CPU); the scheduler runs
at most max_loras distinct adapters per step; `_prepare` gives each of the step's adapters a GPU
slot (copying it in if it is not there) and tells the worker each sequence's slot.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..checks import check_int
from ..distributed.kv_transfer import make_kv_connector
from ..distributed.kv_transfer.config import check_role
from ..executor import Executor, UniprocExecutor
from ..inputs import check_length, prompt_ids
from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest, check_lora_request
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..sequence import Sequence, append_sampled, make_sequences, token_text
from ..spec_decode import SpecDecodeMetrics, load_drafter
from ..worker.model_input import ModelInput
from .block_manager import BlockManager
from .config import EngineConfig
from .kv_eviction import make_kv_eviction, reserved_blocks
from .kv_offload import KVOffloadPool
from .overlap_steps import OverlapSteps, needs_host_sampling
from .prefix_cache import make_prefix_cache
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode_steps import SpecDecodeSteps
from .stats import EngineStats
from .step_input import prepare_decode_input, prepare_model_input, sampling_input
from .structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[list[float]] = field(default_factory=list)  # per completion, when each token came


@dataclass(eq=False)  # a request is itself (hashable by identity), not equal to one like it
class SequenceGroup:
    """One request: its prompt and its n sequences (vLLM's name)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    pending_forks: list[Sequence]  # sequences 1..n-1 until the prompt is computed
    error: str | None = None  # why a failed step ended this request
    lora_request: LoRARequest | None = None  # its adapter (chapter 16)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].finished if len(seqs) == 1 else all(s.finished for s in seqs)

    def to_output(self, speculative: bool = False, detokenize: bool = True) -> RequestOutput:
        spec = SpecDecodeMetrics()
        for s in self.seqs if speculative else ():
            spec = spec.merge(s.spec)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [s.to_output(detokenize) for s in self.seqs],
                             finished=self.finished, metrics=self.metrics, error=self.error,
                             spec=spec if speculative else None)


class LLMEngine(SpecDecodeSteps, OverlapSteps):
    def __init__(self, model, tokenizer, eos_token_ids: list[int], config: EngineConfig | None = None,
                 progress: bool = True, executor: Executor | None = None):
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        vocab = model.config.vocab_size
        bad = [t for t in eos_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:  # a sequence could never stop on them, and banning them before min_tokens would fail
            raise ValueError(f"eos_token_ids {bad} are not token ids of this model (0..{vocab - 1})")
        self.eos_token_ids = list(eos_token_ids)
        self.structured = StructuredOutputManager(tokenizer, vocab, self.eos_token_ids,  # chapter 14
                                                  config.structured_outputs_backend)
        self.spec_config = spec = config.speculative_config
        if executor is None:  # the model in this process (chapter 11 passes one worker per GPU instead)
            draft = load_drafter(spec, model) if spec is not None else None  # a draft model, heads, a layer
            executor = UniprocExecutor(model, config, draft)
        self.executor = executor
        self.sizes = executor.sizes  # max_model_len and what memory allows: worked out once
        self.max_model_len = self.sizes.max_model_len
        if spec is not None and spec.num_speculative_tokens + 2 > self.max_model_len:
            raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} is too "
                             f"large for max_model_len={self.max_model_len}")
        num_gpu_blocks, num_cpu_blocks = executor.determine_num_blocks()
        executor.initialize_cache(num_gpu_blocks, num_cpu_blocks, progress)
        self.sizes = executor.sizes
        self.engine_stats = EngineStats()  # every counter of the engine's parts, in one object
        reserved = reserved_blocks(config)  # the worker's own blocks at the pool's end (chapter 15)
        if num_gpu_blocks - reserved < 2:
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks} leaves no room beside the {reserved} blocks "
                             f"kv_positions='cache' keeps for rotated sinks (sink blocks x max_num_seqs)")
        eviction = make_kv_eviction(config, model.config)
        num_offload = getattr(self.sizes, "num_offload_blocks", 0)  # chapter 15's CPU tier (kv_offload.py)
        if num_offload and eviction is not None:  # "auto" on a model whose every layer slides
            raise ValueError(f"kv_offload cannot run with kv_eviction={eviction.name!r} (this model's sliding "
                             "windows free blocks a restored prefix would need): pass kv_eviction='none'")
        self.block_manager = BlockManager(num_gpu_blocks - reserved, config.block_size, num_cpu_blocks,
                                          make_prefix_cache(config.enable_prefix_caching, config.block_size),
                                          self.engine_stats, track_changes=True,  # the worker keeps the tables
                                          eviction=eviction,
                                          offload=KVOffloadPool(num_offload, config.block_size) if num_offload else None)
        kv = config.kv_transfer_config  # chapter 17: the scheduler's side of the connector
        if kv is not None and not isinstance(executor, UniprocExecutor):  # each rank holds a slice of the heads
            raise ValueError("kv_transfer_config needs a one-worker engine (tensor_parallel_size=1): a KV connector "
                             "does not yet move a tensor-parallel cache, whose heads are split over the ranks")
        self.kv_connector = make_kv_connector(kv, config.block_size, self.sizes.kv_cache_spec) if kv else None
        self.scheduler = Scheduler(config, self.block_manager, self.kv_connector)
        self.has_proposer = spec is not None
        # overlap pays where a GPU runs beside the host; H2O/SnapKV rank blocks by the step just run (kv_eviction.py)
        auto = self.sizes.device.type == "cuda" and config.kv_eviction not in ("h2o", "snapkv")
        self.async_scheduling = auto if config.async_scheduling is None else config.async_scheduling
        self._host_sampled: set[str] = set()  # requests the overlapped step cannot sample (overlap_steps.py)
        if spec is not None:
            self.scheduler.num_lookahead = self._num_lookahead
        self.groups: dict[str, SequenceGroup] = {}
        self.lora = None  # chapter 16: the adapters' CPU pool and GPU slots
        if config.enable_lora:
            self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                    in_use=lambda: {g.lora_request.lora_int_id for g in self.groups.values()
                                                    if g.lora_request is not None}, stats=self.engine_stats)
        self._group_of: dict[int, SequenceGroup] = {}
        self._seq_ids, self._arrivals = itertools.count(1), itertools.count()
        # False: the outputs step() returns carry text None (Sequence.to_output). The server's engine core
        # sets it: its API process detokenizes the token ids (deltas.py), off the process that steps.
        self.detokenize = True

    # ---- requests --------------------------------------------------------------------------------

    def check_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                      priority: int = 0, lora_request: LoRARequest | None = None,
                      ) -> tuple[str | None, list[int], SamplingParams]:
        """Everything add_request refuses, without queueing anything: -> (text, token ids, a private
        copy of the params, checked). LLM.generate checks a whole list before it queues any of it.
        lora_request: the adapter it runs with (read and checked here; enable_lora=True needed)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__} ({request_id!r})")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int (lower runs first), not {priority!r}")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if check_lora_request("lora_request", lora_request) is not None:
            if not self.config.enable_lora:
                raise ValueError(f"request {request_id!r} has a lora_request, but the engine was built without "
                                 "LoRA: build it with enable_lora=True (and max_loras, max_lora_rank)")
            if self.lora is not None:  # None: a view of an engine in another process, which reads it itself
                self.lora.check(lora_request)
        # A copy, checked again: the caller may have edited the params since they were built, and may
        # edit them again while the request runs; the engine's copy stays what was checked.
        params = copy.copy(params)  # verify() below puts new lists in place of stop and stop_token_ids
        params.verify(self.model.config.vocab_size)
        if params.structured_outputs is not None:  # a bad schema is refused here, naming the field
            self.structured.validate(params.structured_outputs, f"request {request_id!r}")
        self._check_kv_transfer(params)
        text, ids = prompt_ids(self.tokenizer, self.model.config.vocab_size, prompt, f"request {request_id!r}")
        check_length(f"request {request_id!r}", len(ids), params, self.max_model_len)
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r} asks for n={params.n} sequences, but the engine runs at most "
                             f"max_num_seqs={self.config.max_num_seqs} at once; lower n or raise max_num_seqs")
        need, have = self.block_manager.max_blocks_held(longest), self.block_manager.num_blocks - 1
        if need > have:
            raise ValueError(f"request {request_id!r} may grow to {longest} tokens = {need} KV blocks, but the pool "
                             f"has {have}; lower max_tokens or give the engine more blocks")
        return text, ids, params

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (prompt: str or {"prompt_token_ids": [...]}); refuse one that can never fit."""
        self.add_checked(request_id, *self.check_request(request_id, prompt, params, priority, lora_request),
                         priority, lora_request)

    def add_checked(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queue what check_request returned (the engine core's intake: the API process checked the
        request and carries the result here), without copying and verifying the params again. Two cheap
        guards stay: the id must be new to this engine, and the ids must lie in the vocabulary and fit the
        context, because one request that skipped the check (a race, a bug) would otherwise fail the
        forward pass of every request batched with it."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        name = f"request {request_id!r}"
        prompt_ids(None, self.model.config.vocab_size, {"prompt_token_ids": ids}, name)  # min and max, in C
        self._check_kv_transfer(params)
        check_length(name, len(ids), params, self.max_model_len)
        if lora_request is not None:  # checked in another process (the server's API side): known here too
            if self.lora is None:
                raise ValueError(f"{name} has a lora_request, but the engine was built without enable_lora=True")
            if self.lora.requests.get(lora_request.lora_int_id) != lora_request:
                self.lora.check(lora_request)
        seqs = make_sequences(ids, params, self.tokenizer, self.eos_token_ids, self.max_model_len)
        group = SequenceGroup(request_id, text, ids, params, seqs, RequestMetrics(time.perf_counter()), seqs[1:],
                              lora_request=lora_request)
        group.metrics.token_times = [[] for _ in seqs]
        self.groups[request_id] = group
        if needs_host_sampling(params):
            self._host_sampled.add(request_id)
        compiled = None
        if params.structured_outputs is not None:  # checked already; compiled now (a cache hit for a repeat)
            compiled = self.structured.compile(params.structured_outputs, name)
        for s in seqs:
            s.seq_id = next(self._seq_ids)
            s.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
            self._group_of[s.seq_id] = group
            if compiled is not None:
                self.structured.add(s.seq_id, compiled)
        self.scheduler.add(seqs[0], priority, next(self._arrivals), fanout=len(seqs))

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """A handle (extra_args["kv_transfer_params"]) needs a connector whose role serves it."""
        if params.extra_args:  # (the server's API process runs this too: it reads only the config)
            check_role(self.config.kv_transfer_config, params.extra_args.get("kv_transfer_params"))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests and free their blocks; unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(ids, Iterable) or isinstance(ids, (bytes, dict)):
            raise TypeError(f"request_id must be a str or a list of str, not {type(request_id).__name__}")
        ids = list(ids)
        if not all(isinstance(r, str) for r in ids):
            raise TypeError(f"request ids are str; got {[r for r in ids if not isinstance(r, str)][:3]}")
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self._host_sampled.discard(rid)
            for s in group.seqs:
                if not s.finished:
                    self.scheduler.abort(s)
                self._group_of.pop(s.seq_id, None)
                self.structured.remove(s.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- one step: schedule -> execute -> advance -> sample -> outputs ------------------------------

    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that got new tokens (finished ones for the last
        time). unfinished_outputs=False returns only the requests that finished: a caller that does not
        stream skips copying every running sequence's tokens at every step. With overlap scheduling
        (chapter 13, overlap_steps.py) a step's tokens come out of the next call."""
        if self._can_overlap():
            return self._step_overlapped(unfinished_outputs)
        drained = self._drain() if self._inflight is not None else []  # tokens still on the GPU come first
        return drained + self._step_sync(unfinished_outputs)

    def _move_blocks(self, sched) -> None:
        """The step's block moves, before its forward pass: swaps, copy-on-write, the offload tier's copies."""
        offload = (sched.offload_save, sched.offload_load) if sched.offload_save or sched.offload_load else ()
        # (without offload copies the call is the three-list one an executor of earlier chapters knows)
        self.executor.swap_and_copy(sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy, *offload)
        if offload:
            block_bytes = self.sizes.block_bytes  # one worker's share of a block (its heads, chapter 11)
            self.engine_stats.offload_bytes_to_cpu += len(sched.offload_save) * block_bytes
            self.engine_stats.offload_bytes_to_gpu += len(sched.offload_load) * block_bytes

    def _step_sync(self, unfinished_outputs: bool) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self._move_blocks(sched)
        failed, reserved = self._kv_failed(sched), []
        if self.has_proposer:
            not_proposed, reserved = self._propose(sched)
            failed += not_proposed
        if sched.is_empty:
            return failed
        logits_indices, samplers = self._logits_rows(sched)
        seqs, rows = self._sampling_order(sched, samplers)
        step = self._prepare(sched, logits_indices)
        step.sampling = sampling_input(seqs, rows, bitmask=self.structured.bitmask(seqs)) if seqs else None
        try:
            out = self.executor.execute_model(step)
        except Exception as e:  # the forward pass concerns every scheduled request
            return failed + self._fail({self._group_of[s.seq_id]: e for s, _ in sched.scheduled})
        if out.kv_stats is not None:
            self.engine_stats.kv.add(out.kv_stats)
        if out.kv_block_mass:  # H2O (chapter 15): what each kept block was attended with this step
            self.block_manager.observe_attention(out.kv_block_mass)
        self._advance(sched)
        if not samplers:  # only prompt chunks ran: their K/V are cached, nothing to sample yet
            return failed
        if not sched.decode_only:
            self._join_forks(samplers)
        failed += self._fail(self._append_sampled(seqs, out))
        for seq in reserved:  # slots reserved for drafts that were not proposed, or not accepted
            if not seq.finished:
                self.block_manager.trim(seq.seq_id, seq.num_tokens)
        return failed + self._outputs([s for s in seqs if s.seq_id in self._group_of], unfinished_outputs)

    def _kv_failed(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Chapter 17: end the requests whose remote K/V never came (kv_load_failure_policy "fail"); with
        nothing to compute but transfers to wait for, nap instead of spinning."""
        if sched.is_empty and self.scheduler.connector is not None and self.scheduler.only_transfers:
            time.sleep(0.002)
        if not sched.kv_failed:
            return []
        return self._fail({self._group_of[s.seq_id]: e for s, e in sched.kv_failed if s.seq_id in self._group_of})

    def _prepare(self, sched: SchedulerOutput, logits_indices: list[int]) -> ModelInput:
        """The step as plain data for the executor (step_input.py)."""
        if sched.decode_only:  # one token per sequence, each its last: the short path
            step = prepare_decode_input([s for s, _ in sched.scheduled], self.block_manager.block_tables,
                                        self.config.block_size, self.block_manager.take_table_changes())
        else:
            step = prepare_model_input(sched.scheduled, self.block_manager.block_tables, self.config.block_size,
                                       logits_indices, self.block_manager.take_table_changes())
        step.kv_connector_metadata = sched.kv_connector_metadata
        if self.lora is not None:  # chapter 16: each sequence's adapter slot, and the adapters to copy in
            ids = [s.lora_int_id for s, _ in sched.scheduled]
            if any(ids):
                step.lora_slots, step.lora_loads = self.lora.prepare(ids)
        return step

    def _logits_rows(self, sched: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
        """Which rows of the step's packed tokens get logits (vLLM's logits_indices), and whose they are: a
        sequence samples when this step computes its last known token (not in the middle of a prompt)."""
        if sched.decode_only:  # every sequence runs its last token, one row each: all of them sample
            return list(range(len(sched.scheduled))), [s for s, _ in sched.scheduled]
        rows, seqs, offset = [], [], 0
        for s, n in sched.scheduled:
            offset += n
            k = len(s.spec_token_ids)  # drafts: a row for the last token and each of them
            if s.num_computed_tokens + n == s.num_tokens + k:
                rows += range(offset - 1 - k, offset)
                seqs.append(s)
        return rows, seqs

    def _advance(self, sched: SchedulerOutput, name_blocks: bool = True) -> None:
        """The scheduled tokens' K/V are in the cache now: count them, and name each block they filled
        (name_blocks=False: later, once their tokens are known; overlap_steps.py)."""
        now, bs, stats = time.perf_counter(), self.block_manager.block_size, self.engine_stats
        stats.num_steps += 1
        for seq, n in sched.scheduled:
            if not sched.decode_only:  # (a decoding sequence was scheduled before: its request has the time)
                group = self._group_of[seq.seq_id]
                group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            stats.num_prompt_tokens += max(0, min(seq.num_computed_tokens, len(seq.prompt_ids)) - before)
            # a block just filled: name it for reuse (drafts: only once accepted, in _rollback)
            if name_blocks and before // bs != seq.num_computed_tokens // bs and not seq.spec_token_ids:
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                                     seq.lora_int_id)

    def _sampling_order(self, sched: SchedulerOutput, samplers: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample this step, in the order of the worker's answer, and each one's first
        logits row: a request with n > 1 whose prompt just finished has its n - 1 forks sample their first
        token from its row, each with its own seed. (A sequence with drafts has 1 + k rows, and no forks.)"""
        if sched.decode_only:  # no prompt ended this step: no forks
            return samplers, list(range(len(samplers)))
        seqs, rows, row = [], [], 0
        for seq in samplers:
            group = self._group_of[seq.seq_id]
            if group.pending_forks and seq is group.seqs[0]:
                seqs += group.pending_forks
                rows += [row] * len(group.pending_forks)
            seqs.append(seq)
            rows.append(row)
            row += 1 + len(seq.spec_token_ids)
        return seqs, rows

    def _join_forks(self, samplers: list[Sequence]) -> None:
        """The forks of a prompt that just finished take its blocks and run beside it from now on."""
        for seq in samplers:
            group = self._group_of[seq.seq_id]
            if group.pending_forks and seq is group.seqs[0]:
                for child in group.pending_forks:
                    self.block_manager.fork(seq.seq_id, child.seq_id)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.scheduler.add_running(child, like=seq)
                group.pending_forks = []

    def _append_sampled(self, seqs: list[Sequence], out) -> dict[SequenceGroup, Exception]:
        """The worker's tokens appended, stop checks included (a verify's through _append_verified);
        -> the requests whose sampling or appending failed (the others go on)."""
        failed = {self._group_of[seqs[i].seq_id]: e for i, e in out.errors.items()}
        logprobs, text = out.logprobs, None
        for i, (seq, tokens) in enumerate(zip(seqs, out.sampled_token_ids)):
            if not tokens:  # its sampling failed (out.errors)
                continue
            try:
                if seq.spec_token_ids:
                    self._append_verified(seq, tokens)
                    continue
                self.structured.accept(seq.seq_id, tokens[0])  # its grammar moves on (chapter 14)
                lp = logprobs[i] if logprobs is not None else None
                if lp is None:
                    seq.append(tokens[0])
                else:
                    text = text or token_text(self.tokenizer)
                    append_sampled(seq, tokens[0], lp, text)
                self.engine_stats.num_generation_tokens += 1
            except Exception as e:
                failed[self._group_of[seq.seq_id]] = e
        return failed

    def _outputs(self, seqs: list[Sequence], unfinished_outputs: bool) -> list[RequestOutput]:
        """Finished sequences leave the scheduler; one RequestOutput per request that got tokens."""
        now = time.perf_counter()
        touched = {}
        for seq in seqs:
            group = self._group_of[seq.seq_id]
            metrics = group.metrics
            metrics.token_times[seq.index].append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if seq.finished:
                self.scheduler.finish(seq)
                touched[group.request_id] = group
            elif unfinished_outputs:  # a caller that does not stream wants only the finished ones
                touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            if group.finished:
                group.metrics.finished_time = now
                self.groups.pop(group.request_id, None)
                self._host_sampled.discard(group.request_id)
                for s in group.seqs:
                    self._group_of.pop(s.seq_id, None)
                    self.structured.remove(s.seq_id)
            if group.finished or unfinished_outputs:
                outputs.append(group.to_output(self.has_proposer, self.detokenize))
        return outputs

    def _fail(self, errors: dict[SequenceGroup, Exception]) -> list[RequestOutput]:
        """End these requests with finish_reason "error" and free their blocks; the rest go on."""
        outputs = []
        for group, error in errors.items():
            # one line per failed request; the traceback only at debug level (a broken request is not a crash)
            logger.error("request %r failed in its step: %s: %s", group.request_id, type(error).__name__, error)
            logger.debug("request %r: the step's traceback", group.request_id, exc_info=error)
            group.error = f"{type(error).__name__}: {error}"
            for s in group.seqs:
                s.finish_reason = s.finish_reason or "error"
                self.scheduler.abort(s)
                self._group_of.pop(s.seq_id, None)
                self.structured.remove(s.seq_id)
            self.groups.pop(group.request_id, None)
            self._host_sampled.discard(group.request_id)
            group.metrics.finished_time = time.perf_counter()
            self.engine_stats.num_failed_requests += 1
            outputs.append(group.to_output(self.has_proposer, self.detokenize))
        return outputs

    # ---- warm-up ---------------------------------------------------------------------------------

    def warm_up(self, max_prompt_len: int | None = None) -> float:
        """Run one tiny request per prompt-length bucket now, so that Triton's autotuning and compiling
        of the prefill kernel, and the capture of every token bucket's CUDA graph, happen here and not
        inside the first real requests' latency (vLLM, too, runs dummy batches before it serves).
        Returns the seconds it took. Each bucket runs its longest prompt, one token less and the longest
        multiple of 16 in it (Triton compiles apart for those), up to max_prompt_len (default: the token
        budget). Needs an idle engine; leaves it idle, its statistics as they were."""
        check_int("max_prompt_len", max_prompt_len, optional=True)
        if self.has_unfinished_requests():
            raise ValueError("warm_up needs an idle engine (it has unfinished requests)")
        budget = self.config.max_num_batched_tokens
        limit = min(budget if max_prompt_len is None else max_prompt_len, budget, self.max_model_len - 1,
                    (self.block_manager.num_blocks - 1) * self.block_manager.block_size - 1)
        if limit < 1:  # a pool of one block of one token: nothing fits beside the generated token
            return 0.0
        lengths = {1}
        for k in range(4, limit.bit_length() + 1):  # bucket 2^k holds the lengths in (2^(k-1), 2^k]
            n = min(2**k, limit)
            lengths |= {m for m in (n, n - 1, n - n % 16) if m > 2 ** (k - 1)}
        vocab, saved = self.model.config.vocab_size, self.engine_stats.snapshot()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.executor.capture_token_buckets()  # every bucket up to the budget, whatever the prompt limit
        for n in sorted(lengths):  # one at a time: each step's longest chunk is the prompt itself
            self.add_request(f"warm-up-{n}", {"prompt_token_ids": [(7 * i + n) % vocab for i in range(n)]}, params)
            while self.has_unfinished_requests():
                self.step(unfinished_outputs=False)
        self.engine_stats.restore(saved)  # the prompts' blocks stay in a prefix cache, the first to be evicted
        return time.perf_counter() - t0

    # ---- convenience -----------------------------------------------------------------------------

    def stream(self, request_id: str, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Add a request and step the engine (everyone else advances too) until it finishes."""
        self.add_request(request_id, prompt, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
            if request_id not in self.groups:  # aborted meanwhile
                return

    @property
    def stats(self) -> dict:
        """engine_stats as one dict, with the pool's size (what the bench and the notebooks print)."""
        pc = self.block_manager.prefix_cache
        d = self.engine_stats.as_dict()
        if self.kv_connector is not None:  # chapter 17: what moved, and the requests whose transfer failed
            d.update(kv_load_failures=self.kv_connector.num_load_failures,
                     kv_send_timeouts=self.kv_connector.num_send_timeouts)
        return {"num_blocks": self.block_manager.num_blocks, **d,
                "prefix_hit_rate": d["prefix_hit_rate"] if pc else None}

    def shutdown(self) -> None:
        """Let the executor give its memory back (the pool, the CUDA graphs and their buffers), so another
        engine, or a peer in the same process, gets the GPU's memory back."""
        self.executor.shutdown()

    # the in-process worker's parts (UniprocExecutor), for tests, benchmarks and notebooks that look inside
    @property
    def runner(self):
        return self.executor.runner

    @property
    def cache(self):
        return self.executor.cache

    @property
    def proposer(self):
        return self.executor.proposer if self.has_proposer else None

