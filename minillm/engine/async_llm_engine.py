"""AsyncLLMEngine: LLMEngine behind an asyncio front, for the HTTP server (chapter 12).

    engine = AsyncLLMEngine(lambda: LLM("model/").engine)     # built and warmed up in its own thread
    engine.start()                                            # inside the server's running event loop
    async for out in engine.generate("r1", ids, SamplingParams(max_tokens=8)):
        print(out.outputs[0].text, end="")                    # deltas: only what is new

One thread owns the engine. It builds it, warms it up, and then loops: take what the event loop
sent (new requests, aborts), step the engine while anyone has work, and hand each request's new
tokens back. Nothing else touches the engine; the two sides meet in two places only:

    event loop -> engine thread   a queue.Queue of commands ("add", "abort", "stop")
    engine thread -> event loop   loop.call_soon_threadsafe, once per step, with every request's
                                  delta; each request reads its own asyncio.Queue

Why a thread and not an asyncio task in the server's loop: a step is a forward pass, milliseconds
on a GPU and up to seconds on a CPU, and it does not yield. Run in the loop, it would freeze every
connection while it runs: no SSE chunk would leave, no new request would be read, no disconnect
noticed. In a thread, the loop keeps serving HTTP while the step runs (PyTorch lets go of the GIL
inside its kernels and while it waits for the GPU). vLLM went further and moved its engine core into
another process; one thread is the smallest design that keeps the loop free.

Each request's stream carries RequestOutputs in delta form (vLLM's RequestOutputKind.DELTA): every
CompletionOutput holds only the text, token ids and logprobs that are new since the last one.
Text comes from Sequence.stream_delta, which holds back what could still be the start of a stop
string, so a stop string never reaches a client. The last output of a request has finished=True and,
as its `metrics`, a FinishedStats. A request whose step failed ends with finish_reason "error" and
RequestOutput.error; an aborted one (its client went away) with "abort", its blocks freed in the
engine thread before the next step.

`check` (LLMEngine.check_request) runs on the caller's thread so a bad request is refused before it
is queued, with an HTTP status rather than a broken stream. It reads only what is fixed once the
engine is built (the tokenizer, the vocabulary, the context and the pool size); the request id it
checks for uniqueness is the caller's own, and the caller makes ids unique.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from ..outputs import CompletionOutput, RequestOutput
from ..sampling import SamplingParams
from ..sequence import SequenceStatus

logger = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The engine is still loading, failed to load, or is shutting down: try again later (503)."""


@dataclass(frozen=True)
class FinishedStats:
    """How one request went, in time.perf_counter() seconds: the final output's `metrics`."""

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
    """What the engine holds right now, published by its thread after every step (for /metrics)."""

    running: int = 0  # requests with a sequence in the running batch
    waiting: int = 0  # requests held with no sequence running: not started yet, or preempted
    used_blocks: int = 0  # KV blocks held by sequences
    num_blocks: int = 0  # KV blocks in the pool (block 0, reserved, not counted)
    stats: dict | None = None  # engine.engine_stats.as_dict(): preemptions, steps, tokens


class _Tracked:
    """The engine thread's view of one request: its sequences and how much of each was sent."""

    def __init__(self, group, arrival: float):
        self.group, self.arrival = group, arrival
        self.scheduled: float | None = None  # the start of the first step that ran it
        self.sent = [0] * len(group.seqs)  # output tokens already handed out, per sequence
        self.done = [False] * len(group.seqs)

    def delta(self) -> RequestOutput | None:
        outs = []
        for i, seq in enumerate(self.group.seqs):
            if self.done[i]:
                continue
            n, start = len(seq.output_ids), self.sent[i]
            text = seq.stream_delta()
            if n == start and not seq.finished and not text:
                continue
            logprobs = seq.logprobs[start:n] if seq.logprobs is not None else None
            self.sent[i], self.done[i] = n, seq.finished
            outs.append(CompletionOutput(seq.index, text, seq.output_ids[start:n],
                                         seq.cumulative_logprob if logprobs is not None else None, logprobs,
                                         seq.finish_reason, seq.stop_reason))
        if not outs:
            return None
        finished = all(self.done)
        return RequestOutput(self.group.request_id, None, self.group.prompt_ids, outs, finished=finished,
                             metrics=self.stats() if finished else None, error=self.group.error)

    def stats(self) -> FinishedStats:
        seqs, m = self.group.seqs, self.group.metrics
        reasons = [s.finish_reason for s in seqs]
        reason = next((r for r in ("error", "abort") if r in reasons), reasons[0])
        return FinishedStats(self.arrival, m.first_token_time, time.perf_counter(), len(self.group.prompt_ids),
                             tuple(len(s.output_ids) for s in seqs), reason, self.scheduled)


class AsyncLLMEngine:
    def __init__(self, make_engine: Callable[[], object], warm_up: bool | str = "auto",
                 on_finished: Callable[[RequestOutput], None] | None = None):
        """make_engine builds the LLMEngine (it runs in the engine thread). warm_up: True, False, or
        "auto" = on a GPU only (where Triton compiles and CUDA graphs are captured; a CPU has neither).
        on_finished is called on the event loop with every request's final output, whoever reads its
        stream (the server counts its metrics there)."""
        self._make_engine, self._warm_up, self.on_finished = make_engine, warm_up, on_finished
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}  # event loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.engine = None  # set by the engine thread; read here only for its fixed parts
        self.load_error: str | None = None  # why building the engine failed
        self.dead: str | None = None  # why the engine thread stopped serving
        self.accepting = True  # False once shutdown began
        self.load = EngineLoad()
        self.warm_up_seconds: float | None = None

    # ---- the event loop's side -------------------------------------------------------------------

    def start(self, on_dead: Callable[[], None] | None = None) -> None:
        """Start the engine thread (call from the running event loop). on_dead is called on the loop
        if the engine cannot be built or its thread stops for good."""
        self._loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has built the engine (or failed to); False on timeout."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        try:
            self.check_ready()
            return True
        except EngineNotReady:
            return False

    def check(self, request_id: str, prompt, params: SamplingParams):
        """LLMEngine.check_request: -> (text, ids, checked params copy), or ValueError/TypeError."""
        self.check_ready()
        return self.engine.check_request(request_id, prompt, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    out: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a checked request; its deltas arrive on `out` (several requests may share one)."""
        self.check_ready()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        out = asyncio.Queue() if out is None else out
        self._streams[request_id] = out
        self._commands.put(("add", request_id, prompt_ids, params, time.perf_counter()))
        return out

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (their client is gone); their blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._commands.put(("abort", ids))

    async def stream(self, requests: list[tuple[str, list[int], SamplingParams]]) -> AsyncIterator[RequestOutput]:
        """Add requests and yield their deltas as they come, until all have finished. Whoever stops
        reading early (an error, a cancelled task: the client went away) aborts the rest."""
        async with aclosing(self.stream_batches(requests)) as batches:
            async for batch in batches:
                for delta in batch:
                    yield delta

    def stream_batches(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestStream:
        """stream(), a list at a time, and eager: the requests are queued for the engine now, not when
        the stream is first read (the server queues them before it sends the response's headers, so
        the engine's prefill overlaps them). See RequestStream."""
        return RequestStream(self, requests)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """One request's deltas (stream() of one)."""
        async for delta in self.stream([(request_id, prompt_ids, params)]):
            yield delta

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, abort those in flight, stop the thread and free the engine's memory."""
        self.accepting = False
        self.abort_all()
        self._commands.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    def check_ready(self) -> None:
        if not self.accepting:
            raise EngineNotReady("the server is shutting down")
        if self.dead is not None or self.load_error is not None:
            raise EngineNotReady(f"the engine is not serving: {self.dead or self.load_error}")
        if not self._ready.is_set():
            raise EngineNotReady("the model is still loading; try again shortly (GET /health says when)")

    def _deliver(self, batch: list[RequestOutput]) -> None:
        """On the event loop: hand one step's deltas to their streams."""
        for delta in batch:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
            if delta.finished:
                self._streams.pop(delta.request_id, None)
                if self.on_finished is not None:
                    try:
                        self.on_finished(delta)
                    except Exception:  # a metrics bug must not stop the deliveries
                        logger.exception("on_finished failed")

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
            if self._warm_up is True or (self._warm_up == "auto" and self.engine.sizes.device.type == "cuda"):
                self.warm_up_seconds = self.engine.warm_up()
        except Exception as e:
            logger.exception("building the engine failed")
            self.load_error = f"{type(e).__name__}: {e}"
            self._stopped()
            return
        self._ready.set()
        tracked: dict[str, _Tracked] = {}
        try:
            self._serve(tracked)
        except Exception as e:  # a bug outside any one request's step: nothing can be trusted now
            logger.exception("the engine thread failed")
            self.dead = f"{type(e).__name__}: {e}"
            for tr in tracked.values():
                tr.group.error = tr.group.error or self.dead
                for s in tr.group.seqs:
                    s.finish_reason = s.finish_reason or "error"
            try:
                self._publish(tracked)  # every stream ends, with the error
            finally:
                self._stopped()
            return
        self.engine.shutdown()

    def _stopped(self) -> None:
        self._ready.set()
        if self._on_dead is not None:
            self._call_soon(self._on_dead)

    def _serve(self, tracked: dict[str, _Tracked]) -> None:
        engine = self.engine
        stopping = False
        while not (stopping and not tracked):
            busy = engine.has_unfinished_requests()
            commands = [self._commands.get()] if not busy else []  # idle: sleep until someone asks
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                stopping |= self._apply(cmd, tracked)
            if engine.has_unfinished_requests():
                began = time.perf_counter()
                try:
                    engine.step(unfinished_outputs=False)  # outputs are read off the sequences below
                except Exception as e:  # LLMEngine.step ends failing requests itself; this is worse
                    logger.exception("engine step failed; ending the requests in flight")
                    self._fail_all(tracked, e)
                for tr in tracked.values():  # who ran for the first time (the step stamps it after its forward)
                    if tr.scheduled is None and tr.group.metrics.first_scheduled_time is not None:
                        tr.scheduled = began
            self._publish(tracked)

    def _apply(self, cmd: tuple, tracked: dict[str, _Tracked]) -> bool:
        """Run one command from the event loop; True for "stop"."""
        engine = self.engine
        if cmd[0] == "add":
            _, rid, ids, params, arrival = cmd
            try:
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
            except Exception as e:  # checked before queueing, so this is a race or a bug: end it cleanly
                self._call_soon(self._deliver, [_failed_output(rid, ids, e, arrival)])
                return False
            tracked[rid] = _Tracked(engine.groups[rid], arrival)
        elif cmd[0] == "abort":
            engine.abort_request([r for r in cmd[1] if r in tracked])  # marks them "abort", frees blocks
        elif cmd[0] == "stop":
            return True
        return False

    def _fail_all(self, tracked: dict[str, _Tracked], error: Exception) -> None:
        for rid, tr in tracked.items():
            tr.group.error = tr.group.error or f"{type(error).__name__}: {error}"
            unfinished = [s for s in tr.group.seqs if not s.finished]
            self.engine.abort_request(rid)  # frees their blocks, marks them "abort"
            for s in unfinished:
                s.finish_reason = "error"

    def _publish(self, tracked: dict[str, _Tracked]) -> None:
        """Send every request's delta to the event loop in one call, and refresh the load figures."""
        batch, running, waiting = [], 0, 0
        for rid, tr in list(tracked.items()):
            delta = tr.delta()
            if delta is not None:
                batch.append(delta)
                if delta.finished:
                    del tracked[rid]
                    continue
            if any(s.status is SequenceStatus.RUNNING for s in tr.group.seqs):
                running += 1
            else:
                waiting += 1
        bm = self.engine.block_manager  # the load first: a client that sees a delta sees its step's load
        self.load = EngineLoad(running, waiting, bm.num_used_blocks, bm.num_blocks - 1,
                               self.engine.engine_stats.as_dict())
        if batch:
            self._call_soon(self._deliver, batch)


class RequestStream:
    """The deltas of some requests, as lists: every delta that has arrived by the time the reader
    asks. A reader that keeps up gets one step's deltas per list; one that fell behind (the event
    loop was busy) gets several steps' at once, and the server writes them to the socket in one go,
    so under load the loop's cost per token falls instead of the backlog growing.

    The requests are added when it is made. Closing it (aclose(), or the reader cancelled while it
    waits), or dropping it unread (a response whose client left before its body began), aborts the
    requests that have not finished."""

    def __init__(self, engine: AsyncLLMEngine, requests: list[tuple[str, list[int], SamplingParams]]):
        self._engine, self._out, self.pending = engine, asyncio.Queue(), set()
        try:
            for rid, ids, params in requests:
                engine.add_request(rid, ids, params, self._out)
                self.pending.add(rid)
        except BaseException:
            self.close()
            raise

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if not self.pending:
            raise StopAsyncIteration
        try:
            batch = [await self._out.get()]
        except BaseException:  # cancelled: nobody will read the rest
            self.close()
            raise
        while not self._out.empty():
            batch.append(self._out.get_nowait())
        for delta in batch:
            if delta.finished:
                self.pending.discard(delta.request_id)
        return batch

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self.pending:
            self._engine.abort(self.pending)  # a put on a thread-safe queue: safe from __del__ too
            self.pending = set()

    def __del__(self):
        self.close()


def _failed_output(rid: str, ids: list[int], error: Exception, arrival: float) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(rid, None, ids, [CompletionOutput(0, "", [], finish_reason="error")],
                         metrics=FinishedStats(arrival, None, now, len(ids), (0,), "error"),
                         error=f"{type(error).__name__}: {error}")
