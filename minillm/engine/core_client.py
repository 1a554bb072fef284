"""Where the engine core runs: a thread of the server's process, or a process of its own (chapter 12).

    thread    the engine core (engine_core.py) in a thread beside the event loop. One process, one
              GIL: while the loop encodes and writes SSE chunks the engine cannot step, and the other
              way round.
    process   vLLM V1's split: a child process (multiprocessing, "spawn": CUDA cannot be forked)
              builds the model and runs the core; the API process keeps HTTP, JSON, chat templates
              and the checks. Two GILs: the step and the SSE writes run at the same time.

            API process (event loop)                          engine core process
    add/abort ──(one message a call, at once)────────> pipe ──> reader thread ──> queue.Queue
                                                                                      │
    streams <── deliver <── add_reader wakes the loop <── pipe <── ("out", rows, load)
                              (drains every message queued)        one message per engine pass

A request's prompts are added in one call (AsyncLLMEngine.add_requests), so the objects their adds share
(one stop list) are pickled once. Each message out is pickled plain tuples (engine_core's rows) behind their length, read by the loop
without ever blocking (FrameReader: a message larger than the pipe arrives over several wake-ups).
The child's side (its main, the reader thread, the framing) is core_process.py. The core's reader thread always drains the
command pipe, so the loop's writes never wait on a step. If the core process dies, its pipe's end
closes: the loop sees end-of-file, marks the engine dead and ends every stream with an error. If the
API process dies, the core sees end-of-file on its command pipe, aborts everything and exits; as a
daemonic child it is also ended when the API process exits normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import queue
import threading

from .core_process import (
    OUT_PIPE_BYTES,
    FrameReader,
    build_engine,
    freeze_gc_heap,
    run_core_process,
    unfreeze_gc_heap,
)
from .engine_core import EngineCore

logger = logging.getLogger(__name__)

ENGINE_CORES = ("thread", "process")


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on the event loop, from any thread; nothing once the loop is closed (nobody listens)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


class InprocClient:
    """The engine core in a thread of this process.

    A client knows its front (the AsyncLLMEngine) only by the five callbacks it reports through, as
    vLLM's clients hand their front outputs and nothing else:
        on_core_ready(engine, warm_up_seconds)   any thread: the engine is built and warmed up
        on_core_load_failed(reason)              any thread: it could not be built
        on_core_output(rows, load)               on the loop: a pass's rows (or several passes') and load
        on_core_dying(reason)                    any thread: the core failed; refuse new requests now
        on_core_ended(reason)                    on the loop: the core is gone (reason None: as asked)"""

    def __init__(self, make_engine, warm_up, front):
        self.make_engine, self.warm_up, self.front = make_engine, warm_up, front
        self.commands: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self.thread.start()

    def send(self, cmd: tuple) -> None:
        self.commands.put(cmd)  # thread-safe: callable from __del__ on any thread too

    def send_many(self, cmds: list[tuple]) -> None:
        for cmd in cmds:  # one process: the objects are shared as they are
            self.commands.put(cmd)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    async def join(self, timeout: float) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, timeout)

    def _run(self) -> None:
        front, loop = self.front, self.loop
        try:
            engine, seconds = build_engine(self.make_engine, self.warm_up)
        except Exception as e:
            logger.exception("building the engine failed")
            front.on_core_load_failed(f"{type(e).__name__}: {e}")
            return
        front.on_core_ready(engine, seconds)

        def publish(rows, load):  # rows as they are: each reader makes its outputs of those it finds
            call_soon(loop, front.on_core_output, rows, load)

        # on_core_dying runs here, before the last publish: nobody may add to a dead core
        reason = EngineCore(engine, self.commands, publish, front.on_core_dying).run()
        unfreeze_gc_heap()  # build_engine froze it: the engine's memory is the collector's to free again
        if reason is None:
            engine.shutdown()
        call_soon(loop, front.on_core_ended, reason)


class MPClient:
    """The engine core in a child process; the event loop reads its messages with loop.add_reader."""

    def __init__(self, make_engine, warm_up, front):
        self.make_engine, self.warm_up, self.front = make_engine, warm_up, front
        self.loop: asyncio.AbstractEventLoop | None = None
        self.proc = None
        self._cmd_conn = self._out_conn = None
        self._frames = FrameReader()
        self._pending: list[tuple] = []
        self._flush_scheduled, self._stopping, self._ended = False, False, False
        self._load_failed, self._dying = False, None  # what the core said before its pipe closed
        self._loop_thread: int | None = None  # the event loop's thread, where commands leave at once

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop (AsyncLLMEngine.start)."""
        self.loop = loop
        self._loop_thread = threading.get_ident()
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd_conn = ctx.Pipe(duplex=False)
        self._out_conn, out_w = ctx.Pipe(duplex=False)
        _widen(self._out_conn)
        _widen(self._cmd_conn)
        level = logging.getLogger().getEffectiveLevel()
        self.proc = ctx.Process(target=run_core_process, name="minillm-engine-core", daemon=True,
                                args=(self.make_engine, self.warm_up, cmd_r, out_w, level))
        self.proc.start()
        cmd_r.close()  # the child's ends: closed here, so its death is an end-of-file
        out_w.close()
        os.set_blocking(self._out_conn.fileno(), False)  # read what is there, never wait for the rest
        loop.add_reader(self._out_conn.fileno(), self._on_readable)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def send(self, cmd: tuple) -> None:
        """Send a command to the core. On the event loop's thread it leaves now (with anything buffered
        before it): in a burst one pass of the loop runs hundreds of request handlers, and a command
        held until the next pass waited behind all of them (for 384 requests on a 2-core CPU, a median
        of 0.2-0.5 s) while the core stepped the few requests it had. A pickle and a pipe write are
        microseconds, a request's handler a millisecond or more. From another thread (__del__ of a
        stream dropped unread) it is buffered, and the loop sends it at its next pass."""
        self.send_many([cmd])

    def send_many(self, cmds: list[tuple]) -> None:
        """send() for several commands, pickled as one message: an object they share (one request's
        stop list, in each of its prompts' params) is written once and arrives as one object."""
        self._pending.extend(cmds)  # list.extend of a list is atomic: __del__ on another thread may call this
        if threading.get_ident() == self._loop_thread:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            call_soon(self.loop, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False  # first: a command appended from now on schedules another flush
        cmds, self._pending = self._pending, []
        if cmds and not self._ended:
            try:
                self._cmd_conn.send(cmds)
            except OSError:  # the core is gone; the end-of-file on its pipe ends the streams
                pass

    def _on_readable(self) -> None:
        """On the loop, once per wake-up: every message the core has queued, its rows delivered in one
        go, as they are (a loop that fell behind gets several steps at once; each reader merges its
        requests' rows into one output each, deltas.py)."""
        if self._ended:
            return
        front, batch, load = self.front, [], None
        messages, eof = self._frames.read(self._out_conn.fileno())
        for msg in messages:
            if msg[0] == "out":
                batch += msg[1]
                load = msg[2]
            elif msg[0] == "ready":
                freeze_gc_heap()  # the tokenizer just unpickled, with the imports: not walked while serving
                front.on_core_ready(msg[1], msg[2])
            elif msg[0] == "load_error":
                self._load_failed = True
                front.on_core_load_failed(msg[1])
            elif msg[0] == "dead":
                self._dying = msg[1]
                front.on_core_dying(msg[1])
        if load is not None:  # every message read, as one delivery with the latest load
            front.on_core_output(batch, load)
        if eof:
            self._end()

    def _end(self) -> None:
        """The core's pipe closed: it exited. Reap it; if nobody asked it to, the engine is dead."""
        if self._ended:
            return
        self._ended = True
        unfreeze_gc_heap()
        self.loop.remove_reader(self._out_conn.fileno())
        self._out_conn.close()
        self._cmd_conn.close()
        self.proc.join(5)
        if self._load_failed:  # said already
            return
        reason = None
        if self._dying is not None or not self._stopping:
            reason = self._dying or f"the engine core process exited with code {self.proc.exitcode}"
        self.front.on_core_ended(reason)

    async def join(self, timeout: float) -> None:
        self._stopping = True
        await asyncio.to_thread(self.proc.join, timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop in %.0f s; terminating it", timeout)
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 5)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5)
        self._on_readable()  # what it sent last, then its end-of-file


def _widen(conn) -> None:
    """Let a pipe hold ~1 MiB instead of 64 KiB. The core's (dozens of steps' deltas): a core whose pipe
    is full waits in send(), so a loop behind by a few steps would hold the engine back again. The
    commands' (hundreds of requests, ~1.4 KB each at 300 prompt tokens): an event loop whose write
    finds the pipe full waits, every connection with it, until the core's reader thread gets its
    GIL back from a step (the burst of scripts/serve_steps_cpu.py fills 64 KiB in ~45 requests)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or over the limit: keep the default
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, OUT_PIPE_BYTES)
