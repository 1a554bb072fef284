"""LLMEngine: requests in, tokens out, many requests at once (chapter 07).

    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one scheduler step: every running sequence advances
            print(out.request_id, out.outputs[0].text, out.finished)

One step = Scheduler.schedule (who runs, how many tokens, which blocks move) -> ModelRunner
(block copies, the forward pass, logits at each sequence whose computed tokens reach its end) ->
the Sampler (one token per sequence, each with its own parameters and seed) -> stop checks ->
finished sequences leave and free their blocks at once.

A request with n > 1 prefills its prompt once: its first sequence runs alone until the prompt is
computed, then the other n - 1 fork its blocks (BlockManager.fork) and sample their first token
from the same logits, each with its own seed. A request that can never fit (its prompt plus
max_tokens beyond the context or the whole block pool) is refused in add_request; everything else
is served, under memory pressure by preemption.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..cache.paged import PagedKVCache
from ..generation import append_tokens, make_sequences
from ..inputs import check_length, prompt_ids
from ..outputs import RequestOutput
from ..sampling import Sampler, SamplingMetadata, SamplingParams
from ..sequence import Sequence
from .block_manager import BlockManager
from .config import EngineConfig, positive_int
from .model_runner import ModelRunner
from .prefix_cache import make_prefix_cache
from .scheduler import Scheduler

CPU_KV_CACHE_BYTES = 512 * 2**20  # KV pool on a CPU when num_gpu_blocks is not given


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[list[float]] = field(default_factory=list)  # per completion, when each token came


@dataclass
class SequenceGroup:
    """One request: its prompt and its n sequences (vLLM's name)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    pending_forks: list[Sequence]  # sequences 1..n-1 until the prompt is computed

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [s.to_output() for s in self.seqs],
                             finished=self.finished, metrics=self.metrics)


class LLMEngine:
    def __init__(self, model, tokenizer, eos_token_ids: list[int], config: EngineConfig | None = None,
                 progress: bool = True):
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, list(eos_token_ids)
        mc = model.config
        param = next(model.parameters())
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        block_bytes = PagedKVCache.block_bytes(mc, config.block_size, param.dtype)
        if config.num_gpu_blocks is not None:
            num_blocks = config.num_gpu_blocks
        elif param.device.type == "cuda":
            num_blocks = PagedKVCache.blocks_for_memory(mc, config.block_size, param.dtype, param.device,
                                                        config.gpu_memory_utilization)
        else:
            num_blocks = max(2, CPU_KV_CACHE_BYTES // block_bytes)
        num_cpu = config.num_cpu_blocks
        if num_cpu is None:  # CPU blocks only matter for swapping
            num_cpu = int(config.swap_space * 2**30) // block_bytes if config.preemption_mode == "swap" else 0
        self.cache = PagedKVCache.for_model(mc, num_blocks, config.block_size, param.dtype, param.device, num_cpu)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_cpu,
                                          make_prefix_cache(config.enable_prefix_caching, config.block_size))
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model, self.cache, config, self.max_model_len)
        self.runner.capture_cuda_graphs(progress)
        self.sampler = Sampler()
        self.groups: dict[str, SequenceGroup] = {}
        self._group_of: dict[int, SequenceGroup] = {}
        self._seq_ids, self._arrivals = itertools.count(1), itertools.count()

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request (prompt: str or {"prompt_token_ids": [...]}); refuse one that can never fit."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int (lower runs first), not {priority!r}")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = prompt_ids(self.tokenizer, self.model.config.vocab_size, prompt, f"request {request_id!r}")
        check_length(f"request {request_id!r}", len(ids), params, self.max_model_len)
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r} asks for n={params.n} sequences, but the engine runs at most "
                             f"max_num_seqs={self.config.max_num_seqs} at once; lower n or raise max_num_seqs")
        need, have = self.block_manager.blocks_needed(longest), self.block_manager.num_blocks - 1
        if need > have:
            raise ValueError(f"request {request_id!r} may grow to {longest} tokens = {need} KV blocks, but the pool "
                             f"has {have}; lower max_tokens or give the engine more blocks")
        seqs = make_sequences(ids, params, self.tokenizer, self.eos_token_ids, self.max_model_len)
        group = SequenceGroup(request_id, text, ids, params, seqs, RequestMetrics(time.perf_counter()), seqs[1:])
        group.metrics.token_times = [[] for _ in seqs]
        self.groups[request_id] = group
        for s in seqs:
            s.seq_id = next(self._seq_ids)
            self._group_of[s.seq_id] = group
        self.scheduler.add(seqs[0], priority, next(self._arrivals), fanout=len(seqs))

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests and free their blocks; unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for s in group.seqs:
                if not s.finished:
                    self.scheduler.abort(s)
                self._group_of.pop(s.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------------------------

    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that got new tokens (finished ones for the last
        time). unfinished_outputs=False returns only the requests that finished: a caller that does not
        stream skips copying every running sequence's tokens at every step."""
        sched = self.scheduler.schedule()
        self.runner.swap_and_copy(sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
        if sched.is_empty:
            return []
        now = time.perf_counter()
        # a sequence samples when this step computes its last known token (not in the middle of a prompt)
        rows = [i for i, (s, n) in enumerate(sched.scheduled) if s.num_computed_tokens + n == s.num_tokens]
        logits = self.runner.execute(sched.scheduled, self.block_manager.block_tables, rows)  # [len(rows), V]
        bs = self.block_manager.block_size
        for seq, n in sched.scheduled:
            group = self._group_of[seq.seq_id]
            group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            if before // bs != seq.num_computed_tokens // bs:  # a block just filled: name it for reuse
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if not rows:  # only prompt chunks ran: their K/V are cached, nothing to sample yet
            return []
        seqs, take = [], []
        for row, i in enumerate(rows):
            seq = sched.scheduled[i][0]
            group = self._group_of[seq.seq_id]
            if group.pending_forks and seq is group.seqs[0]:  # the prompt is done: the other n - 1 join
                for child in group.pending_forks:
                    self.block_manager.fork(seq.seq_id, child.seq_id)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.scheduler.add_running(child, like=seq)
                    seqs.append(child)
                    take.append(row)
                group.pending_forks = []
            seqs.append(seq)
            take.append(row)
        if len(take) != logits.shape[0]:
            logits = logits[torch.tensor(take, device=logits.device)]  # [len(seqs), vocab]
        self._sample(seqs, logits)
        now = time.perf_counter()
        touched = {}
        for seq in seqs:
            group = self._group_of[seq.seq_id]
            group.metrics.token_times[seq.index].append(now)
            group.metrics.first_token_time = group.metrics.first_token_time or now
            if seq.finished:
                self.scheduler.finish(seq)
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            if group.finished:
                group.metrics.finished_time = now
                self.groups.pop(group.request_id, None)
                for s in group.seqs:
                    self._group_of.pop(s.seq_id, None)
            if group.finished or unfinished_outputs:
                outputs.append(group.to_output())
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        params = [s.params for s in seqs]
        banned = [s.banned_tokens() for s in seqs]
        if all(_plain_greedy(p) for p in params) and not any(banned):  # the common case, without the setup
            for s, t in zip(seqs, logits.argmax(dim=-1).tolist()):
                s.append(t)
            return
        meta = SamplingMetadata.build(params, [s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                                      [s.seed for s in seqs], banned, logits.shape[1], logits.device)
        append_tokens(seqs, self.sampler(logits, meta), self.tokenizer)

    # ---- warm-up ---------------------------------------------------------------------------------

    def warm_up(self, max_prompt_len: int | None = None) -> float:
        """Run one tiny request per prompt-length bucket now, so that Triton's autotuning and compiling
        of the prefill kernel, and the capture of the CUDA graph of each token bucket, happen here and
        not inside the first real requests' latency (vLLM, too, runs dummy batches before it serves).
        Returns the seconds it took.

        The attention kernel tunes once per power-of-two bucket of a step's longest prompt chunk, and
        Triton compiles apart for token counts that are and are not multiples of 16; so each bucket
        runs its longest prompt, one token less and the longest multiple of 16 in it, up to
        max_prompt_len (default: the token budget; longer prompts are cut into chunks of it anyway).
        The CUDA graphs of steps with prompt tokens are captured for every token bucket up to the
        budget, on dummy inputs (a step mixing several prompts can fill the budget whatever
        max_prompt_len says). Tuning is kept per process, so one engine's warm-up tunes every later
        engine over the same model shape and dtype; graphs belong to one engine.
        Needs an idle engine; leaves it idle with its statistics as they were (the prompts' blocks
        stay in a prefix cache, unreferenced, the first to be evicted)."""
        if max_prompt_len is not None:
            positive_int("max_prompt_len", max_prompt_len)
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
        bm, pc, vocab = self.block_manager, self.block_manager.prefix_cache, self.model.config.vocab_size
        saved = (bm.peak_used, self.scheduler.num_preemptions, pc and (pc.queries, pc.query_tokens, pc.hit_tokens))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.runner.capture_token_buckets()  # every bucket up to the budget, whatever the prompt limit
        for n in sorted(lengths):  # one at a time: each step's longest chunk is the prompt itself
            self.add_request(f"warm-up-{n}", {"prompt_token_ids": [(7 * i + n) % vocab for i in range(n)]}, params)
            while self.has_unfinished_requests():
                self.step(unfinished_outputs=False)
        bm.peak_used, self.scheduler.num_preemptions = saved[0], saved[1]
        if pc is not None:
            pc.queries, pc.query_tokens, pc.hit_tokens = saved[2]
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
        bm, pc = self.block_manager, self.block_manager.prefix_cache
        return {"num_blocks": bm.num_blocks, "peak_used_blocks": bm.peak_used,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_hit_rate": pc.hit_rate if pc else None,
                "prefix_hit_tokens": pc.hit_tokens if pc else 0}

    def shutdown(self) -> None:
        """Detach the cache from the model and let its memory go (the pool, the CUDA graphs and their
        buffers), so another engine, or a peer in the same process, gets the GPU's memory back."""
        self.cache.unbind(self.model)
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
            self.runner.graphs = None  # the static buffers too; what is left runs eagerly
        self.cache.k_caches.clear()
        self.cache.v_caches.clear()


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.temperature == 0 and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)
