"""The worker samples: a step's logits -> its tokens, before anything crosses back to the engine.

The engine sends with each step a SamplingInput (model_input.py): which logits rows belong to which
sequence, each sequence's parameters, seed and RNG counter, its banned tokens and its draft tokens.
The worker answers with tokens and plain numbers (ModelRunnerOutput), so the logits never leave the
device that made them. Every path a token can take starts at the same place:

    rows       the sequences' rows of logits, in order (a prompt's n > 1 forks share its row)
    masks      apply_token_masks: the one point where tokens are forbidden (EOS before min_tokens
               today; a grammar's bitmask in chapter 14) - every path below sees the masked logits
    then one of
      greedy   every sequence plain greedy: one argmax, copied once (no metadata to build)
      host     the Sampler: penalties, temperature, top-k/p, min-p, logprobs (chapter 02)
      device   overlap scheduling (chapter 13): sampled on the device, the copy to the host started,
               nothing waited for
      verify   sequences with drafts (chapter 09): the rejection sampler, or its greedy rule on
               the host when the whole batch is greedy

When sampling the batch fails, each sequence is sampled alone (per-sequence seeds give the same tokens
whatever the batch), so only the one at fault gets an error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..sampling import Sampler, SamplingMetadata
from ..sampling.device_sampler import SampledTokens, sample_on_device
from ..sampling.rejection_sampler import RejectionSampler, draft_rows_of, emit, spec_metadata
from ..sampling.sampler import logprob_lists
from ..sampling.token_mask import apply_token_masks
from .model_input import ModelRunnerOutput, SamplingInput


def greedy_tokens(logits: torch.Tensor) -> list[int] | None:
    """[R, V] -> each row's argmax, copied to the host once; None when some row is broken (a NaN, which
    argmax would pick, or nothing above -inf, where it would pick token 0): the Sampler's guard decides
    those (chapter 02), so the fast path never emits a token the slow path would not."""
    best, tokens = logits.max(dim=-1)  # [R], [R]: one pass gives both
    tokens = torch.where(best > float("-inf"), tokens, -1).tolist()  # NaN > -inf is False: -1 marks both
    return None if -1 in tokens else tokens


def plain_greedy(p) -> bool:
    """A request whose token is the argmax and nothing else: no logprobs to report, no penalties."""
    return (p.temperature == 0 and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)


class StepSampler:
    """The worker's sampling: the Sampler, the rejection sampler and the device sampler's buffers."""

    def __init__(self, max_num_seqs: int):
        self.sampler, self.rejection_sampler = Sampler(), RejectionSampler()
        self.max_num_seqs = max_num_seqs
        self._pinned: list[torch.Tensor] | None = None  # two pinned buffers taking turns (sample_device)
        self._mask_pinned: list[list] = []  # two [rows, W] int32 pinned buffers + their copy's event (masks)
        self.deferred: tuple[torch.Tensor, SamplingInput] | None = None  # logits waiting for their bitmask

    def __call__(self, logits: torch.Tensor, s: SamplingInput) -> ModelRunnerOutput:
        """logits [rows of the step, V] -> the tokens of every sequence s describes."""
        logits = _sequence_rows(logits, s)  # [R, V], each sequence's 1 + k rows together
        masked = apply_token_masks(logits, _per_row(s.banned, s.num_draft),  # the one mask point
                                   self.upload_bitmask(s, logits.device))
        if s.on_device:
            return ModelRunnerOutput([], pending=self.sample_device(masked, s))
        try:
            tokens, logprobs = self.sample_rows(logits, masked, s, list(range(len(s.params))))
            return ModelRunnerOutput(tokens, logprobs)
        except Exception:
            pass
        out = ModelRunnerOutput([[] for _ in s.params], [None] * len(s.params))
        starts = _starts(s.num_draft)
        for i in range(len(s.params)):  # alone: only the sequence at fault fails
            rows = slice(starts[i], starts[i + 1])
            try:
                tokens, logprobs = self.sample_rows(logits[rows], masked[rows], s, [i])
                out.sampled_token_ids[i], out.logprobs[i] = tokens[0], logprobs[0]
            except Exception as e:
                out.errors[i] = e
        return out

    def sample_rows(self, raw: torch.Tensor, masked: torch.Tensor, s: SamplingInput,
                    seqs: list[int]) -> tuple[list[list[int]], list]:
        """The rows of sequences `seqs` (indices into s) -> (tokens per sequence, logprobs per sequence)."""
        num_draft = [s.num_draft[i] for i in seqs]
        params = [s.params[i] for i in seqs]
        if not any(num_draft):
            return self._sample_plain(raw, masked, s, seqs)
        if all(plain_greedy(p) for p in params):
            argmax = greedy_tokens(masked)  # one sync, no metadata
            if argmax is not None:  # the rejection sampler's greedy rule, on the host
                drafts = _drafts(s, seqs)
                accepted = [d == argmax[r] for d, r in zip(drafts, draft_rows_of(num_draft))]
                return emit(num_draft, drafts, accepted, argmax), [None] * len(seqs)
        starts = _starts(num_draft)
        plain = [j for j, k in enumerate(num_draft) if not k]
        spec = [j for j, k in enumerate(num_draft) if k]
        tokens: list[list[int]] = [[] for _ in seqs]
        logprobs: list = [None] * len(seqs)  # a verified sequence has none (logprobs never draft)
        if plain:  # sequences without drafts this step, logprobs and all
            at = torch.tensor([starts[j] for j in plain], device=raw.device)
            got, lps = self._sample_plain(raw[at], masked[at], s, [seqs[j] for j in plain])
            for j, t, lp in zip(plain, got, lps):
                tokens[j], logprobs[j] = t, lp
        at = torch.tensor([r for j in spec for r in range(starts[j], starts[j + 1])], device=raw.device)
        emitted = self._verify(masked[at], s, [seqs[j] for j in spec])
        for j, t in zip(spec, emitted):
            tokens[j] = t
        return tokens, logprobs

    def _sample_plain(self, raw, masked, s: SamplingInput, seqs: list[int]):
        """One row each: the greedy fast path, else the Sampler (logprobs from the raw logits)."""
        params = [s.params[i] for i in seqs]
        if all(plain_greedy(p) for p in params):
            tokens = greedy_tokens(masked)
            if tokens is not None:
                return [[t] for t in tokens], [None] * len(seqs)
        penalties = s.prompt_ids is not None
        meta = SamplingMetadata.build(params, [s.prompt_ids[i] for i in seqs] if penalties else [[]] * len(seqs),
                                      [s.output_ids[i] for i in seqs] if penalties else [[]] * len(seqs),
                                      [s.seeds[i] for i in seqs], [[]] * len(seqs), masked.shape[1],
                                      masked.device, steps=[s.steps[i] for i in seqs])
        ids, logprobs = logprob_lists(self.sampler(masked, meta, raw=raw), [p.logprobs for p in params])
        return [[t] for t in ids], logprobs

    def _verify(self, masked: torch.Tensor, s: SamplingInput, seqs: list[int]) -> list[list[int]]:
        """Sequences with drafts: their k + 1 rows each -> the tokens each emits (chapter 09)."""
        num_draft = [s.num_draft[i] for i in seqs]
        meta = spec_metadata([s.params[i] for i in seqs], [s.seeds[i] for i in seqs], [s.steps[i] for i in seqs],
                             num_draft, masked.shape[1], masked.device)
        probs = None
        if s.draft_probs is not None:  # [k_i, V] per drafting sequence: these ones' rows
            d0 = _starts([s.num_draft[i] - 1 for i in range(len(s.params))])  # draft offsets, sequence by sequence
            at = [d0[i] + j for i in seqs for j in range(s.num_draft[i])]
            every = torch.cat(s.draft_probs)  # [sum k, V]
            probs = every[torch.tensor(at, device=every.device)]
        return self.rejection_sampler(masked, num_draft, _drafts(s, seqs), probs, meta)

    def upload_bitmask(self, s: SamplingInput, device: torch.device) -> torch.Tensor | None:
        """The grammars' bitmask [S, W] numpy -> one row per logits row [R, W] int32 on the device (None:
        no grammar). On a GPU through pinned memory, so the copy is queued behind the step's work and the
        host does not wait (a copy from pageable memory may wait for the stream: CUDA stages it). Two
        pinned buffers take turns, each rewritten only once its last copy has run (its event)."""
        if s.bitmask is None:
            return None
        mask = torch.from_numpy(np.ascontiguousarray(s.bitmask, dtype=np.int32))  # [S, W] int32
        if device.type == "cuda":
            S, W = mask.shape
            if not self._mask_pinned or self._mask_pinned[0][0].shape[0] < S or self._mask_pinned[0][0].shape[1] != W:
                rows = max(S, self.max_num_seqs)
                self._mask_pinned = [[torch.empty(rows, W, dtype=torch.int32, pin_memory=True), None] for _ in range(2)]
            self._mask_pinned.reverse()
            slot = self._mask_pinned[0]
            if slot[1] is not None:
                slot[1].synchronize()  # its copy of two masked steps ago (normally long done)
            host = slot[0][:S]
            host.copy_(mask)  # a host memcpy, [S, W]
            mask = host.to(device, non_blocking=True)
            slot[1] = torch.cuda.Event()
            slot[1].record()
        if any(s.num_draft):
            reps = [1 + k for k in s.num_draft]  # output_size given: no sync to learn the result's length
            mask = mask.repeat_interleave(torch.tensor(reps, device=mask.device), dim=0, output_size=sum(reps))
        return mask.to(device)  # [R, W] (a no-op where it is there already)

    def sample_device(self, masked: torch.Tensor, s: SamplingInput) -> SampledTokens:
        """Queue the step's sampling on the GPU (chapter 13). Two pinned buffers take turns receiving
        the tokens: the one written now held the tokens of two steps ago, read by the time this step
        was launched."""
        buffer, R = None, masked.shape[0]
        if masked.device.type == "cuda":
            if self._pinned is None or self._pinned[0].numel() < R:
                self._pinned = [torch.empty(max(R, self.max_num_seqs), dtype=torch.int64, pin_memory=True)
                                for _ in range(2)]
            self._pinned.reverse()
            buffer = self._pinned[0]
        return sample_on_device(masked, s.params, s.seeds, s.steps, buffer)


def sample_step(sampler: StepSampler, logits: torch.Tensor, sampling: SamplingInput | None):
    """A step's logits -> (its ModelRunnerOutput, the tokens left on the device for the next step or
    None): the worker's last stage, and the fake executor's (executor/fake.py). A step whose bitmask
    comes later (sampling.defer_bitmask: overlap with a grammar, chapter 14) keeps its logits here
    and returns (None, None); sample_deferred finishes it."""
    if sampling is None:  # the step asked for its logits (tests, labs, chapter 09's bench)
        return ModelRunnerOutput([], logits=logits), None
    if sampling.defer_bitmask:
        sampler.deferred = (logits, sampling)  # [R, V] on the device; nothing runs on it until the mask comes
        return None, None
    out = sampler(logits, sampling)
    return out, (out.pending.next_input if out.pending is not None else None)


def sample_deferred(sampler: StepSampler, bitmask):
    """The deferred step's bitmask ([S, W] int32 numpy or None) -> sample_step's answer for it (vLLM's
    sample_tokens(grammar_output) after execute_model)."""
    if sampler.deferred is None:
        raise ValueError("sample_tokens: no step is waiting for its bitmask (execute_model a step with "
                         "defer_bitmask=True first)")
    (logits, s), sampler.deferred = sampler.deferred, None
    return sample_step(sampler, logits, dataclasses.replace(s, bitmask=bitmask, defer_bitmask=False))


def _starts(num_draft: list[int]) -> list[int]:
    """Each sequence's first row among the sampled rows (1 + k rows each), and the end."""
    starts = [0]
    for k in num_draft:
        starts.append(starts[-1] + 1 + k)
    return starts


def _drafts(s: SamplingInput, seqs: list[int]) -> list[int]:
    d0 = _starts([k - 1 for k in s.num_draft])  # sequence i's drafts start at d0[i] in draft_token_ids
    return [t for i in seqs for t in s.draft_token_ids[d0[i] : d0[i] + s.num_draft[i]]]


def _per_row(banned: list[list[int]], num_draft: list[int]) -> list[list[int]] | None:
    """Each sequence's banned tokens on each of its rows; None when nothing is banned (the usual step)."""
    if not any(banned):
        return None
    return [b for b, k in zip(banned, num_draft) for _ in range(k + 1)]


def _sequence_rows(logits: torch.Tensor, s: SamplingInput) -> torch.Tensor:
    """The step's logits rows -> each sampled sequence's rows in order (a fork repeats its prompt's row)."""
    take = [r for first, k in zip(s.rows, s.num_draft) for r in range(first, first + 1 + k)]
    if take == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(take, device=logits.device)]  # [R, V]
