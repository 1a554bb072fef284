"""Where the engine core runs: a thread of the server's process, or a process of its own (chapter 12).

    thread    the engine core (engine_core.py) in a thread beside the event loop. One process, one
              GIL: while the loop encodes and writes SSE chunks the engine cannot step, and the other
              way round.
    process   vLLM V1's split: a child process (multiprocessing, "spawn": CUDA cannot be forked)
              builds the model and runs the core; the API process keeps HTTP, JSON, chat templates
              and the checks. Two GILs: the step and the SSE writes run at the same time.

            API process (event loop)                          engine core process
    add/abort ──(one message each, at once)──────────> pipe ──> reader thread ──> queue.Queue
                                                                                      │
    streams <── deliver <── add_reader wakes the loop <── pipe <── ("out", rows, load)
                              (drains every message queued)        one message per engine pass

Each message out is pickled plain tuples (engine_core's rows) behind their length, read by the loop
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


class InprocCore:
    """The engine core in a thread of this process. `front` is the AsyncLLMEngine it serves."""

    def __init__(self, front):
        self.front, self.commands = front, queue.Queue()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self.thread.start()

    def send(self, cmd: tuple) -> None:
        self.commands.put(cmd)  # thread-safe: callable from __del__ on any thread too

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    async def join(self, timeout: float) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, timeout)

    def _run(self) -> None:
        front = self.front
        try:
            engine, front.warm_up_seconds = build_engine(front.make_engine, front.warm_up)
        except Exception as e:
            logger.exception("building the engine failed")
            front.call_soon(front.load_failed, f"{type(e).__name__}: {e}")
            front.ready_event.set()
            return
        front.engine = engine
        front.ready_event.set()

        def publish(rows, load):
            front.load = load  # the load first: a client that sees a delta sees its step's load
            if rows:  # as they are: each reader makes its outputs of the rows it finds (deltas.py)
                front.call_soon(front.deliver, rows)

        def fatal(reason):
            front.dead = reason  # before the last deliveries: nobody may add to a dead core

        reason = EngineCore(engine, self.commands, publish, fatal).run()
        unfreeze_gc_heap()  # build_engine froze it: the engine's memory is the collector's to free again
        if reason is not None:
            front.call_soon(front.core_ended, reason)
            return
        engine.shutdown()


class ProcCore:
    """The engine core in a child process; the event loop reads its messages with loop.add_reader."""

    def __init__(self, front):
        self.front = front
        self.proc = None
        self._cmd_conn = self._out_conn = None
        self._frames = FrameReader()
        self._pending: list[tuple] = []
        self._flush_scheduled, self._stopping, self._ended = False, False, False
        self._loop_thread: int | None = None  # the event loop's thread, where commands leave at once

    def start(self) -> None:
        """On the event loop (AsyncLLMEngine.start)."""
        self._loop_thread = threading.get_ident()
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd_conn = ctx.Pipe(duplex=False)
        self._out_conn, out_w = ctx.Pipe(duplex=False)
        _widen(self._out_conn)
        _widen(self._cmd_conn)
        level = logging.getLogger().getEffectiveLevel()
        self.proc = ctx.Process(target=run_core_process, name="minillm-engine-core", daemon=True,
                                args=(self.front.make_engine, self.front.warm_up, cmd_r, out_w, level))
        self.proc.start()
        cmd_r.close()  # the child's ends: closed here, so its death is an end-of-file
        out_w.close()
        os.set_blocking(self._out_conn.fileno(), False)  # read what is there, never wait for the rest
        self.front.loop.add_reader(self._out_conn.fileno(), self._on_readable)

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
        self._pending.append(cmd)  # list.append is atomic: __del__ on another thread may call this
        if threading.get_ident() == self._loop_thread:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self.front.call_soon(self._flush)

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
        front, batch = self.front, []
        messages, eof = self._frames.read(self._out_conn.fileno())
        for msg in messages:
            if msg[0] == "out":
                front.load = msg[2]
                batch += msg[1]
            elif msg[0] == "ready":
                front.engine, front.warm_up_seconds = msg[1], msg[2]
                freeze_gc_heap()  # the tokenizer just unpickled, with the imports: not walked while serving
                front.ready_event.set()
            elif msg[0] == "load_error":
                front.load_failed(msg[1])
            elif msg[0] == "dead":
                front.dead = msg[1]
        if batch:
            front.deliver(batch)
        if eof:
            self._end()

    def _end(self) -> None:
        """The core's pipe closed: it exited. Reap it; if nobody asked it to, the engine is dead."""
        if self._ended:
            return
        self._ended = True
        unfreeze_gc_heap()
        self.front.loop.remove_reader(self._out_conn.fileno())
        self._out_conn.close()
        self._cmd_conn.close()
        self.proc.join(5)
        front = self.front
        front.ready_event.set()
        if front.load_error is None and (front.dead is not None or not self._stopping):
            front.core_ended(front.dead or f"the engine core process exited with code {self.proc.exitcode}")

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
