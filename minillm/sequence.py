"""Sequence: one completion being generated, and the rules that end it.

A request with n = 3 becomes three Sequences that share the prompt. Each keeps its own output ids,
its own text (through the incremental detokenizer of chapter 01) and its own random seed, and
after every new token checks, in this order:

    stop token id -> "stop" (stop_reason = the id)        EOS (unless ignore_eos) -> "stop"
    stop string in the text -> "stop", the text cut before it (stop_reason = the string); the one
        that ends first wins, ties to the first in the list (all matched at once: stop_strings.py)
    max_tokens reached, or the context full -> "length"

A stop string can straddle tokens ("Hel" + "lo."); checking the text, not the tokens, finds it.
"""

from __future__ import annotations

import enum
import random

from .outputs import CompletionOutput, Logprob
from .sampling import SamplingParams
from .sampling.sampler import logprob_lists
from .spec_decode.metrics import SpecDecodeMetrics
from .stop_strings import StopMatcher
from .tokenizer import IncrementalDetokenizer
from .tokenizer.detokenizer import known_ids

_GOLDEN = 0x9E3779B97F4A7C15


class SequenceStatus(enum.Enum):
    """Where the engine's scheduler keeps a sequence (chapter 07)."""

    WAITING = "waiting"  # no KV blocks: not started, or preempted to be recomputed
    RUNNING = "running"  # holds GPU blocks, is scheduled every step
    SWAPPED = "swapped"  # preempted, its blocks parked in CPU memory
    # chapter 17: its prompt's K/V are to come from another engine and are not there yet (vLLM's name)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"


class Sequence:
    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, seed: int, tokenizer,
                 eos_ids: list[int], max_len: int):
        self.index, self.prompt_ids, self.params, self.seed = index, prompt_ids, params, seed
        self.output_ids: list[int] = []
        self.eos_ids = [] if params.ignore_eos else list(eos_ids)
        self.max_len = max_len  # prompt + output may not exceed this (the model's context)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        # The text is detokenized when someone reads it (a stream, the final output), not per token in
        # the step (chapter 13: at batch 256 the per-token detokenizer was a quarter of the host's step).
        # Stop strings need the text at every token, so those sequences detokenize as they go; the
        # server's engine core sends text only for them, and token ids for the rest (engine_core.py).
        self._text, self._detok_upto, self._flushed = "", 0, False
        self.eager_text = bool(params.stop)
        # every stop string at once, each new character read once (the cost of str.find per stop per
        # token grew with the number of stops, inside the step every request waits for)
        self._stops = StopMatcher(params.stop) if params.stop else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self._streamed = 0  # characters of text already handed to a stream
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        # The engine's bookkeeping (chapter 07); the one-request path of generation.py ignores it.
        self.seq_id = -1
        self.lora_int_id = 0  # its adapter (chapter 16; 0: the base model): GPU slot and prefix-cache key
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # Speculative decoding (chapter 09): this step's draft tokens (verified after the last token, not
        # part of token_ids until accepted), the distributions they were drawn from ([k, vocab] or None),
        # how many positions a draft model's own cache holds, and the acceptance counters.
        self.spec_token_ids: list[int] = []
        self.spec_probs = None
        self.num_draft_computed = 0
        # Overlap scheduling (chapter 13): a token sampled on the GPU whose value the host does not know
        # yet (at most one), and its row in that step's sampled-token tensor; it counts in num_tokens so
        # the scheduler can give the sequence its next step before the token reaches the host.
        self.num_pending = 0
        self.pending_row = -1
        # len(token_ids) + num_pending, kept up to date by append and the pending-token methods below:
        # the scheduler, the input packing and the stop checks ask it several times per sequence per
        # step, and at batch 256 recomputing it was a visible share of the host's step (chapter 13)
        self.num_tokens = len(prompt_ids)
        self.spec = SpecDecodeMetrics()
        # min_acceptance_rate's back-off: the running acceptance rate, the current pause (output tokens)
        # and the output length at which drafting resumes
        self.spec_recent_rate, self.spec_pause, self.spec_resume_at = 1.0, 0, 0
        self.kv_transfer_params: dict | None = None  # chapter 17: the handle a producer's finished request gives

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """token_ids[-1] without building the list; -1 while it is still on the GPU (num_pending)."""
        if self.num_pending:
            return -1
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    # ---- overlap scheduling (chapter 13): tokens sampled on the GPU, not yet seen by the host ------

    def add_pending(self, row: int) -> None:
        """A token is on its way from the GPU, in row `row` of its step's sampled tokens."""
        self.num_pending += 1
        self.num_tokens += 1
        self.pending_row = row

    def take_pending(self) -> None:
        """The oldest pending token reached the host (append() counts it again)."""
        if self.num_pending:
            self.num_pending -= 1
            self.num_tokens -= 1

    def drop_pending(self) -> None:
        """The sequence stopped: tokens sampled after its last one are thrown away."""
        self.num_tokens -= self.num_pending
        self.num_pending = 0

    def banned_tokens(self) -> list[int]:
        """Tokens that may not be sampled now: EOS and stop tokens before min_tokens are out."""
        if len(self.output_ids) < self.params.min_tokens:
            return self.eos_ids + self.params.stop_token_ids
        return []

    @property
    def text(self) -> str:
        """The output decoded so far: the incremental detokenizer catches up on the ids it has not
        seen, in order, so reading it every step or once at the end gives the same string."""
        if self._detok_upto < len(self.output_ids):
            step = self.detok.step
            self._text += "".join(step(t) for t in self.output_ids[self._detok_upto:])
            self._detok_upto = len(self.output_ids)
        if self.finish_reason is not None and not self._flushed and not isinstance(self.stop_reason, str):
            self._text += self.detok.flush()  # an unfinished character at the end becomes U+FFFD, as in decode
            self._flushed = True
        return self._text

    def append(self, token_id: int, logprob: float | None = None, entry: dict[int, Logprob] | None = None) -> None:
        self.output_ids.append(token_id)
        self.num_tokens += 1
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None and entry is not None:
            self.logprobs.append(entry)
        hit = None
        if self.eager_text:  # stop strings are matched in the text this token adds
            before = len(self._text)
            self._text += self.detok.step(token_id)
            self._detok_upto = len(self.output_ids)
            if self._stops is not None:  # read even before min_tokens: a stop may straddle it
                hit = self._stops.feed(self._text, before)
        self._check_stop(token_id, hit)

    def _check_stop(self, token_id: int, hit: tuple[int, str] | None) -> None:
        p = self.params
        num_output = len(self.output_ids)
        # the token and text checks only where something could match (most requests: nothing to check)
        if num_output >= p.min_tokens and (p.stop_token_ids or self.eos_ids or p.stop):
            if token_id in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                return
            if token_id in self.eos_ids:
                self.finish_reason = "stop"
                return
            if hit is not None:  # a stop string that ends in the text this token added
                end, stop = hit
                self._text = self._text[: end if p.include_stop_str_in_output else end - len(stop)]
                self.finish_reason, self.stop_reason = "stop", stop
                return
        if (p.max_tokens is not None and num_output >= p.max_tokens) or self.num_tokens >= self.max_len:
            self.finish_reason = "length"

    def stream_delta(self) -> str:
        """New text that is safe to show: held back by (longest stop string - 1) characters until the
        end, so a stop string that is still forming is never printed."""
        text = self.text
        end = len(text) if self.finished else max(self._streamed, len(text) - self._holdback)
        delta = text[self._streamed : end]
        self._streamed = end
        return delta

    def to_output(self, detokenize: bool = True) -> CompletionOutput:
        """detokenize=False: text None, for a caller that detokenizes the ids itself (the server's API
        process does, deltas.py), so that the engine core does not decode a finished request whole."""
        return CompletionOutput(
            index=self.index, text=self.text if detokenize else None, token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


def sequence_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request whose seed is `seed` (completion 0 keeps it)."""
    return (seed + index * _GOLDEN) % (1 << 63)


def make_sequences(prompt_ids: list[int], params: SamplingParams, tokenizer, eos_ids: list[int],
                   max_len: int) -> list[Sequence]:
    """The n sequences of one request, each with its own seed (an unseeded request draws a fresh one)."""
    base = random.SystemRandom().randrange(1 << 62) if params.seed is None else params.seed
    return [Sequence(i, prompt_ids, params, sequence_seed(base, i), tokenizer, eos_ids, max_len)
            for i in range(params.n)]


def append_tokens(seqs: list[Sequence], out, tokenizer) -> None:
    """Append one sampled token to each sequence (row i of the Sampler's output to seqs[i]), with its
    logprob entry when the request asked for logprobs (chapter 03's one-request path)."""
    ids, logprobs = logprob_lists(out, [s.params.logprobs for s in seqs])
    text = token_text(tokenizer)
    for s, t, lp in zip(seqs, ids, logprobs):
        append_sampled(s, t, lp, text)


def token_text(tokenizer):
    """tid -> its text, for logprob entries; an id past the tokenizer (a padded embedding) has none."""
    known = known_ids(tokenizer)
    return lambda tid: "" if known is not None and tid >= known else tokenizer.decode([tid])


def append_sampled(seq: Sequence, token: int, logprob, text) -> None:
    """One sampled token; logprob: None, or (logprob, rank, top ids, top logprobs) as the worker reports
    it (sampler.logprob_lists): the entry holds the chosen token and the top-k, decoded by text(tid)."""
    if logprob is None:
        seq.append(token)
        return
    lp, rank, top_ids, top_lps = logprob
    entry = {token: Logprob(lp, rank, text(token))}
    for r, (tid, tlp) in enumerate(zip(top_ids, top_lps), start=1):
        entry.setdefault(tid, Logprob(tlp, r, text(tid)))
    seq.append(token, lp, entry)


def new_tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without building the whole list (decode: one token); past the
    sequence's end, its draft tokens of this step (chapter 09: verified beside the last token). A token
    still on its way from the GPU (chapter 13's overlap: Sequence.num_pending) reads as -1."""
    P, end, pending = len(seq.prompt_ids), seq.num_tokens, seq.num_pending
    if pending and start + n > end - pending:
        known = end - pending
        if start >= known:  # the common overlapped decode: the one new token is still on the GPU
            return [-1] * n
        return new_tokens(seq, start, known - start) + [-1] * (start + n - known)
    if start + n > end:
        return new_tokens(seq, start, end - start) + seq.spec_token_ids[: start + n - end]
    if start >= P:
        return seq.output_ids[start - P : start - P + n]
    return (seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - P)])[:n]
