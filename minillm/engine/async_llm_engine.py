"""AsyncLLMEngine: LLMEngine behind an asyncio front, for the HTTP server (chapter 12).

    engine = AsyncLLMEngine(partial(build, "model/"))        # built and warmed up off the event loop
    engine.start()                                            # inside the server's running event loop
    async for out in engine.generate("r1", ids, SamplingParams(max_tokens=8)):
        print(out.outputs[0].text, end="")                    # deltas: only what is new

The engine core (engine_core.py) owns the engine: it builds it, warms it up, and then loops: take
what the event loop sent (new requests, aborts), step the engine while anyone has work, and hand
every request's new tokens back, once per step. Nothing else touches the engine. It runs where
`engine_core` says (core_client.py):

    "thread"    a thread of this process; commands through a queue.Queue, deltas back through
                loop.call_soon_threadsafe, once per step
    "process"   a child process of its own (vLLM V1's EngineCore / AsyncLLM split); commands and
                deltas through pipes, a message per command in and one per step out

Why not an asyncio task in the server's loop: a step is a forward pass, milliseconds on a GPU and
up to seconds on a CPU, and it does not yield; run in the loop, it would freeze every connection.
A thread keeps the loop free, but shares its GIL: while the loop writes SSE chunks the engine cannot
step. A process has a GIL of its own, at the price of pickling each step's deltas across a pipe.

Each request's stream carries RequestOutputs in delta form, built by the reader from the core's rows
(deltas.py); a reader that fell behind gets several steps' rows as one output per request, so under
load the server writes fewer, larger chunks. The core sends token ids; their text is made here, as
each row arrives (deltas.RequestDetokenizer), except where the core had to make it to match stop strings.

`check` (LLMEngine.check_request) runs on the caller's thread so a bad request is refused before it
is queued, with an HTTP status rather than a broken stream. It reads only what is fixed once the
engine is built (the tokenizer, the vocabulary, the context and the pool size: in process mode an
EngineView of them); the request id it checks for uniqueness is the caller's own, and the caller
makes ids unique.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing

from ..outputs import RequestOutput
from ..sampling import SamplingParams
from .core_client import ENGINE_CORES, InprocClient, MPClient, call_soon
from .deltas import Inbox, RequestDetokenizer, outputs_of
from .engine_core import EngineLoad, FinishedStats, failed_row

__all__ = ["AsyncLLMEngine", "EngineLoad", "EngineNotReady", "FinishedStats", "Inbox", "RequestStream", "outputs_of"]

logger = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The engine is still loading, failed to load, or is shutting down: try again later (503)."""


class AsyncLLMEngine:
    def __init__(self, make_engine: Callable[[], object], warm_up: bool | str = "auto",
                 on_finished: Callable[[RequestOutput], None] | None = None, engine_core: str = "thread"):
        """make_engine builds the LLMEngine (where the core runs: in process mode it is pickled to the
        child, so a module-level function or a functools.partial of one; and, as with any "spawn" child, a
        script that starts one needs `if __name__ == "__main__":`). warm_up: True, False, or
        "auto" = on a GPU only (where Triton compiles and CUDA graphs are captured; a CPU has neither).
        on_finished is called on the event loop with every request's final output, whoever reads its
        stream (the server counts its metrics there). engine_core: "thread" or "process"."""
        if engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, not {engine_core!r}")
        if engine_core == "process":
            try:
                pickle.dumps(make_engine)
            except Exception as e:
                raise TypeError(f"engine_core='process' sends make_engine to a child process, so it must pickle "
                                f"(a module-level function or a functools.partial of one), not {make_engine!r}: "
                                f"{e}") from None
        self.make_engine, self.warm_up, self.on_finished = make_engine, warm_up, on_finished
        self.engine_core = engine_core
        self.core = (MPClient if engine_core == "process" else InprocClient)(make_engine, warm_up, self)
        # request id -> (where its rows go, prompt ids, arrival, its detokenizers): the event loop's side only
        self._streams: dict[str, tuple[asyncio.Queue | Inbox, list[int], float, RequestDetokenizer]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready_event = threading.Event()
        self.engine = None  # the LLMEngine (thread) or an EngineView (process): read here for its fixed parts
        self.load_error: str | None = None  # why building the engine failed
        self.dead: str | None = None  # why the engine core stopped serving
        self.accepting = True  # False once shutdown began
        self.load = EngineLoad()
        self.warm_up_seconds: float | None = None
        self._on_dead: Callable[[], None] | None = None

    # ---- the event loop's side -------------------------------------------------------------------

    def start(self, on_dead: Callable[[], None] | None = None) -> None:
        """Start the engine core (call from the running event loop). on_dead is called on the loop
        if the engine cannot be built or its core stops for good."""
        self.loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self.core.start(self.loop)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the core has built the engine (or failed to); False on timeout."""
        return self.ready_event.wait(timeout)

    @property
    def ready(self) -> bool:
        try:
            self.check_ready()
            return True
        except EngineNotReady:
            return False

    def check(self, request_id: str, prompt, params: SamplingParams, lora_request=None):
        """LLMEngine.check_request: -> (text, ids, checked params copy), or ValueError/TypeError."""
        self.check_ready()
        return self.engine.check_request(request_id, prompt, params, lora_request=lora_request)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    out: asyncio.Queue | Inbox | None = None, lora_request=None) -> asyncio.Queue | Inbox:
        """Queue a checked request; its rows (engine_core.py) arrive on `out` (anything with put_nowait;
        several requests may share one; deltas.outputs_of makes RequestOutputs of them). lora_request:
        its adapter (chapter 16), checked with it."""
        return self.add_requests([(request_id, prompt_ids, params)], out, lora_request)

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]],
                     out: asyncio.Queue | Inbox | None = None, lora_request=None) -> asyncio.Queue | Inbox:
        """add_request for each (id, prompt ids, params), sent to the core as one message: one pickle,
        so what the requests share (a multi-prompt request's one stop list) arrives shared, not one
        unpickled copy per prompt (100,000 stops x 1024 prompts took the core from 2.5 to 8.4 GB,
        probe round 4, S1). All of them are checked before any is queued."""
        self.check_ready()
        ids = [rid for rid, _, _ in requests]
        for rid in ids:
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
        if len(set(ids)) < len(ids):
            raise ValueError("the request_ids of one add_requests call must differ")
        out = asyncio.Queue() if out is None else out
        arrival = time.perf_counter()
        cmds = []
        for rid, prompt_ids, params in requests:
            detok = RequestDetokenizer(self.engine.tokenizer, params.skip_special_tokens)
            self._streams[rid] = (out, prompt_ids, arrival, detok)
            cmds.append(("add", rid, prompt_ids, params, arrival, lora_request))
        self.core.send_many(cmds)
        return out

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (their client is gone); their blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self.core.send(("abort", ids))

    async def stream(self, requests: list[tuple[str, list[int], SamplingParams]],
                     lora_request=None) -> AsyncIterator[RequestOutput]:
        """Add requests and yield their deltas as they come, until all have finished. Whoever stops
        reading early (an error, a cancelled task: the client went away) aborts the rest."""
        async with aclosing(self.stream_batches(requests, lora_request)) as batches:
            async for batch in batches:
                for delta in batch:
                    yield delta

    def stream_batches(self, requests: list[tuple[str, list[int], SamplingParams]],
                       lora_request=None) -> RequestStream:
        """stream(), a list at a time, and eager: the requests are queued for the engine now, not when
        the stream is first read (the server queues them before it sends the response's headers, so
        the engine's prefill overlaps them). See RequestStream."""
        return RequestStream(self, requests, lora_request)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """One request's deltas (stream() of one)."""
        async for delta in self.stream([(request_id, prompt_ids, params)]):
            yield delta

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, abort those in flight, stop the core and free the engine's memory."""
        self.accepting = False
        self.abort_all()
        self.core.send(("stop", False))
        await self.core.join(timeout)

    def check_ready(self) -> None:
        if not self.accepting:
            raise EngineNotReady("the server is shutting down")
        if self.dead is not None or self.load_error is not None:
            raise EngineNotReady(f"the engine is not serving: {self.dead or self.load_error}")
        if not self.ready_event.is_set() or self.engine is None:
            raise EngineNotReady("the model is still loading; try again shortly (GET /health says when)")

    # ---- the core client reports through these five (core_client.py) -----------------------------

    def on_core_ready(self, engine, warm_up_seconds: float | None) -> None:
        """Any thread: the engine is built (in process mode an EngineView of it) and warmed up."""
        self.engine, self.warm_up_seconds = engine, warm_up_seconds
        self.ready_event.set()

    def on_core_load_failed(self, reason: str) -> None:
        """Any thread: the engine could not be built."""
        self.load_error = reason
        self.ready_event.set()
        if self._on_dead is not None:
            self.call_soon(self._on_dead)

    def on_core_output(self, rows: list[tuple], load: EngineLoad) -> None:
        """On the loop: one pass's rows, or several passes' (a loop that fell behind), and the load after
        the last of them. The load first: a client that sees a delta sees its step's load."""
        self.load = load
        if rows:
            self.deliver(rows)

    def on_core_dying(self, reason: str) -> None:
        """Any thread: the core failed and is ending its requests; from now on nothing may be added."""
        self.dead = reason

    def on_core_ended(self, reason: str | None) -> None:
        """On the loop: the core is gone. reason None: it stopped as asked (shutdown). Otherwise it
        failed, or its process died: every stream still open ends with the error; then on_dead."""
        self.ready_event.set()  # whoever still waits for the engine: it will not come
        if reason is None:
            return
        self.dead = self.dead or reason
        logger.error("the engine core stopped serving: %s", self.dead)
        self.deliver([failed_row(rid, len(ids), self.dead, arrival) for rid, (_, ids, arrival, _) in self._streams.items()])
        if self._on_dead is not None:
            self._on_dead()

    def deliver(self, rows: list[tuple]) -> None:
        """On the event loop: hand one step's rows (or several steps') to their streams, their text
        filled in from their token ids: the reader makes one output per request of all it finds
        (deltas.py). A request's detokenizers go with its last row (finished, aborted or failed)."""
        streams = self._streams
        for row in rows:
            entry = streams.get(row[0])
            if entry is not None:
                row = entry[3].fill(row)
                entry[0].put_nowait(row)
            if row[1]:  # finished
                streams.pop(row[0], None)
                if self.on_finished is not None:
                    try:
                        prompt = None if entry is None else entry[1]
                        self.on_finished(outputs_of([row], lambda rid, ids=prompt: ids)[0])
                    except Exception:  # a metrics bug must not stop the deliveries
                        logger.exception("on_finished failed")

    def call_soon(self, fn, *args) -> None:
        """fn(*args) on the event loop, from any thread."""
        call_soon(self.loop, fn, *args)


class RequestStream:
    """The deltas of some requests, as lists: every delta that has arrived by the time the reader
    asks. A reader that keeps up gets one step's deltas per list; one that fell behind (the event
    loop was busy) gets several steps' at once, merged to one delta per request, and the server
    writes them as one SSE event per choice: under load the loop's cost per token falls instead of
    the backlog growing.

    The requests are added when it is made. Closing it (aclose(), or the reader cancelled while it
    waits), or dropping it unread (a response whose client left before its body began), aborts the
    requests that have not finished."""

    def __init__(self, engine: AsyncLLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
                 lora_request=None):
        self._engine, self._out, self.pending = engine, Inbox(), set()
        self._prompts = {rid: ids for rid, ids, _ in requests}
        try:
            engine.add_requests(requests, self._out, lora_request)  # one message: shared params stay shared
            self.pending.update(rid for rid, _, _ in requests)
        except BaseException:
            self.close()
            raise

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if not self.pending:
            raise StopAsyncIteration
        try:
            rows = await self._out.take()
        except BaseException:  # cancelled: nobody will read the rest
            self.close()
            raise
        batch = outputs_of(rows, self._prompts.get)
        for delta in batch:
            if delta.finished:
                self.pending.discard(delta.request_id)
        return batch

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self.pending:
            self._engine.abort(self.pending)  # thread-safe (core_client.py): safe from __del__ too
            self.pending = set()

    def __del__(self):
        self.close()
