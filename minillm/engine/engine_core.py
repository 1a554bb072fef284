"""EngineCore: the loop that owns an LLMEngine and steps it while anyone has work (chapter 12).

    core = EngineCore(engine, commands, publish)   # commands: a queue.Queue of the tuples below
    core.run()                                      # until ("stop", ...) and no request is left

It is vLLM V1's EngineCore: the part of the server that touches the model. It does not know where it
runs; core_client.py runs it in a thread of the server's process or in a process of its own. Both
sides speak plain tuples, so the same loop serves both:

    in   ("add", request_id, prompt_ids, params, arrival[, lora_request])    a checked request
         ("abort", [request_id, ...])                         its client went away: free its blocks
         ("stop", abort_all)                                  end once nothing runs (abort_all: now)
    out  publish(rows, load) after every pass                 the new tokens of what it changed, one call

A row is one request's delta as a plain tuple (deltas.outputs_of turns rows into RequestOutputs, on
the reader's side): only what is new since the last one (vLLM's RequestOutputKind.DELTA). Tuples,
because in process mode every row crosses a pipe each step: pickled, they are 4x smaller and faster
than the objects. Plain ones, not NamedTuples: pickle writes an exact tuple in C but a subclass through
__reduce_ex__ in Python, several times slower a step (scripts/row_pickle.py measures it), so the fields
are named where a row is made (_Tracked.row) and where it is read (deltas.py). A pass rows only the requests it can have changed: those with a running sequence,
those it finished, aborted or failed. A request still waiting costs nothing per step, however long
the queue. A row carries token ids, and text only where the core makes it anyway: a sequence with
stop strings matches them in its text as it grows, and its row's text is Sequence.stream_delta,
which holds back what could still be the start of a stop string, so a stop string never reaches a
client. Every other row's text is None, and the API process detokenizes its ids (deltas.py,
vLLM V1's split): decoding every request's tokens here, every step, cost this process CPU time
serialised with the GPU steps it drives (chapter 12 profiles it). A request's last delta has
finished=True and a FinishedStats as `metrics`. A request whose step failed ends with finish_reason
"error" and RequestOutput.error; an aborted one with "abort", its blocks freed before the next step.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedStats:
    """How one request went, in time.perf_counter() seconds: the final output's `metrics`. (Linux's
    perf_counter is CLOCK_MONOTONIC, one clock for every process of the machine.)"""

    arrival_time: float  # when the caller handed it in
    first_token_time: float | None  # None: it ended before its first token
    finished_time: float
    num_prompt_tokens: int
    output_lens: tuple[int, ...]  # tokens of each of its n completions
    finish_reason: str  # of the request: "error" or "abort" if any completion ended so, else completion 0's
    scheduled_time: float | None = None  # when the first engine step that ran it began (queue wait ends)

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds right now, published after every pass (for /metrics)."""

    running: int = 0  # requests with a sequence in the running batch
    waiting: int = 0  # requests held with no sequence running: not started yet, or preempted
    used_blocks: int = 0  # KV blocks held by sequences
    num_blocks: int = 0  # KV blocks in the pool (block 0, reserved, not counted)
    stats: dict | None = None  # engine.engine_stats.as_dict(): preemptions, steps, tokens


class _Tracked:
    """The core's view of one request: its sequences and how much of each was sent."""

    def __init__(self, group, arrival: float):
        self.group, self.arrival = group, arrival
        self.scheduled: float | None = None  # the start of the first step that ran it
        self.sent = [0] * len(group.seqs)  # output tokens already handed out, per sequence
        self.done = [False] * len(group.seqs)

    def row(self) -> tuple | None:
        """(request id, finished, error, FinishedStats or None, [(index, text, token ids, cumulative
        logprob, logprobs, finish reason, stop reason) per completion with news]), or None: no news.
        text is None where the reader detokenizes the ids (every sequence without stop strings)."""
        outs = []
        for i, seq in enumerate(self.group.seqs):
            if self.done[i]:
                continue
            n, start = len(seq.output_ids), self.sent[i]
            text = seq.stream_delta() if seq.eager_text else None
            if n == start and not seq.finished and not text:
                continue
            logprobs = seq.logprobs[start:n] if seq.logprobs is not None else None
            self.sent[i], self.done[i] = n, seq.finished
            outs.append((seq.index, text, seq.output_ids[start:n], seq.cumulative_logprob if logprobs is not None
                         else None, logprobs, seq.finish_reason, seq.stop_reason))
        if not outs:
            return None
        finished = all(self.done)
        return self.group.request_id, finished, self.group.error, self.stats() if finished else None, outs

    def stats(self) -> FinishedStats:
        seqs, m = self.group.seqs, self.group.metrics
        reasons = [s.finish_reason for s in seqs]
        reason = next((r for r in ("error", "abort") if r in reasons), reasons[0])
        return FinishedStats(self.arrival, m.first_token_time, time.perf_counter(), len(self.group.prompt_ids),
                             tuple(len(s.output_ids) for s in seqs), reason, self.scheduled)


class EngineCore:
    def __init__(self, engine, commands: queue.Queue, publish: Callable[[list[tuple], EngineLoad], None],
                 on_fatal: Callable[[str], None] = lambda reason: None):
        """publish(rows, load) is called after every pass, rows possibly empty. on_fatal(reason) is
        called when the loop itself fails (a bug outside any one request's step), before the last
        publish ends every request with the error: whoever serves must refuse new requests first."""
        self.engine, self.commands, self.publish, self.on_fatal = engine, commands, publish, on_fatal
        self.tracked: dict[str, _Tracked] = {}
        self._refused: list[tuple] = []  # rows of adds the engine refused: ended at the next publish
        self._changed: dict[str, None] = {}  # requests this pass may have changed, in order: published next
        self._rid_of_seq: dict[int, str] = {}  # seq_id -> request id, of every tracked request's sequences

    def run(self) -> str | None:
        """Serve until stopped. -> None, or why the loop failed (every request was ended with it)."""
        self.engine.detokenize = False  # the outputs of step() are read for their request ids only
        try:
            self._serve()
        except Exception as e:  # nothing can be trusted now
            logger.exception("the engine core failed")
            reason = f"{type(e).__name__}: {e}"
            self.on_fatal(reason)
            for tr in self.tracked.values():
                tr.group.error = tr.group.error or reason
                for s in tr.group.seqs:
                    s.finish_reason = s.finish_reason or "error"
            self._changed.update(dict.fromkeys(self.tracked))
            self._publish()
            return reason
        finally:
            self.engine.detokenize = True
        return None

    def _serve(self) -> None:
        engine = self.engine
        stopping = False
        while not (stopping and not self.tracked):
            busy = engine.has_unfinished_requests()
            commands = [self.commands.get()] if not busy else []  # idle: sleep until someone asks
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                stopping |= self._apply(cmd)
            if engine.has_unfinished_requests():
                began = time.perf_counter()
                try:
                    finished = engine.step(unfinished_outputs=False)  # the rest is read off the sequences
                except Exception as e:  # LLMEngine.step ends failing requests itself; this is worse
                    logger.exception("engine step failed; ending the requests in flight")
                    self._fail_all(e)
                    finished = []
                self._note_stepped(finished, began)
            self._publish()

    def _note_stepped(self, finished: list, began: float) -> None:
        """Mark what this step can have changed: the requests with a running sequence (a superset of
        those it scheduled; the waiting ones cannot have news) and those it finished. Their first
        schedule is stamped here too. O(running), not O(tracked): a long queue costs nothing per step."""
        changed, seq_rid = self._changed, self._rid_of_seq
        for seq in self.engine.scheduler.running:
            rid = seq_rid.get(seq.seq_id)
            if rid is not None:
                changed[rid] = None
        for out in finished:
            changed[out.request_id] = None
        for rid in changed:
            tr = self.tracked.get(rid)
            if tr is not None and tr.scheduled is None and tr.group.metrics.first_scheduled_time is not None:
                tr.scheduled = began  # who ran for the first time (stamped after its forward)

    def _apply(self, cmd: tuple) -> bool:
        """Run one command; True for "stop"."""
        engine = self.engine
        if cmd[0] == "add":
            _, rid, ids, params, arrival, *lora = cmd  # (chapter 16: its LoRARequest, when the sender has one)
            try:
                # the API side ran check_request: not again here (an adapter unknown to this process is read)
                engine.add_checked(rid, None, ids, params, lora_request=lora[0] if lora else None)
            except Exception as e:  # a reused id (a race) or a bug: end it cleanly
                self._refused.append(failed_row(rid, len(ids), e, arrival))
                return False
            group = engine.groups[rid]
            self.tracked[rid] = _Tracked(group, arrival)
            for s in group.seqs:
                self._rid_of_seq[s.seq_id] = rid
        elif cmd[0] == "abort":
            ids = [r for r in cmd[1] if r in self.tracked]
            engine.abort_request(ids)  # marks them "abort", frees blocks
            self._changed.update(dict.fromkeys(ids))
        elif cmd[0] == "stop":
            if cmd[1]:
                engine.abort_request(list(self.tracked))
                self._changed.update(dict.fromkeys(self.tracked))
            return True
        return False

    def _fail_all(self, error: Exception) -> None:
        for rid, tr in self.tracked.items():
            tr.group.error = tr.group.error or f"{type(error).__name__}: {error}"
            unfinished = [s for s in tr.group.seqs if not s.finished]
            self.engine.abort_request(rid)  # frees their blocks, marks them "abort"
            for s in unfinished:
                s.finish_reason = "error"
        self._changed.update(dict.fromkeys(self.tracked))

    def _publish(self) -> None:
        """The deltas of the requests this pass changed, and the load figures, in one call."""
        batch, self._refused = self._refused, []
        changed, self._changed = self._changed, {}
        for rid in changed:
            tr = self.tracked.get(rid)
            if tr is None:
                continue
            row = tr.row()
            if row is not None:
                batch.append(row)
                if row[1]:  # finished
                    del self.tracked[rid]
                    for s in tr.group.seqs:
                        self._rid_of_seq.pop(s.seq_id, None)
        running = len({self._rid_of_seq[s.seq_id] for s in self.engine.scheduler.running if s.seq_id in self._rid_of_seq})
        bm = self.engine.block_manager
        self.publish(batch, EngineLoad(running, len(self.tracked) - running, bm.num_used_blocks, bm.num_blocks - 1,
                                       self.engine.engine_stats.as_dict()))


def failed_row(rid: str, num_prompt_tokens: int, error: Exception | str, arrival: float) -> tuple:
    """The one row of a request that ended in error before the engine ran it."""
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    stats = FinishedStats(arrival, None, time.perf_counter(), num_prompt_tokens, (0,), "error")
    return rid, True, reason, stats, [(0, "", [], None, None, "error", None)]
