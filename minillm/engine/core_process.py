"""The engine core's own process: what runs in the child that core_client.MPClient spawns, and the
framing of the messages it sends back (chapter 12).

    run_core_process(make_engine, warm_up, commands, out, log_level)    the child's main

The child builds the engine (and freezes its heap: freeze_gc_heap), sends ("ready", EngineView, warm-up seconds) (or ("load_error", why)),
then runs an EngineCore whose every pass sends ("out", rows, load), through a writer thread
(Writer) that pickles and writes while the core goes on to its next step. A reader thread moves the
command lists that come down the other pipe into the core's queue.Queue as they arrive. Messages out
are pickles behind an 8-byte length (write_frame), which the API process reads without blocking
(FrameReader).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import signal
import threading
from types import SimpleNamespace

from .block_manager import BlockManager
from .engine_core import EngineCore
from .llm_engine import LLMEngine
from .structured_output import StructuredOutputManager

OUT_PIPE_BYTES = 1 << 20  # Linux's default limit for a pipe (/proc/sys/fs/pipe-max-size)


def build_engine(make_engine, warm_up) -> tuple[object, float | None]:
    """make_engine(), warmed up if asked (warm_up "auto": on a GPU only), its process's heap frozen
    (freeze_gc_heap) -> (engine, warm-up seconds)."""
    engine = make_engine()
    seconds = None
    if warm_up is True or (warm_up == "auto" and engine.sizes.device.type == "cuda"):
        seconds = engine.warm_up()
    freeze_gc_heap()
    return engine, seconds


def freeze_gc_heap() -> None:
    """Move every object alive now into the collector's permanent generation (vLLM's freeze_gc_heap,
    called once a server is built and warmed up, before it serves).

    A serving process holds hundreds of thousands of objects that live as long as it does: the
    imports (torch, FastAPI, pydantic), the tokenizer's vocabulary and merges (~500,000 for
    SmolLM2's), the model's modules. Python's full collection walks all of them whenever enough
    new objects have survived since the last one, and a burst of requests makes exactly those: in
    the API process, 384 requests at once set off one or two full collections of ~0.5 s each on a
    2-core CPU (scripts/serve_steps_cpu.py), during which the event loop takes in nothing and the
    core steps the few requests it has. Frozen, a full collection walks only what came since.
    Collected first, so today's garbage is not made immortal. unfreeze_gc_heap undoes it when the
    engine stops: a dropped engine's GPU pool is freed only by the collector (cache/paged.py)."""
    gc.collect()
    gc.freeze()


def unfreeze_gc_heap() -> None:
    """The frozen objects back into the oldest generation, collectable again (freeze_gc_heap)."""
    gc.unfreeze()


class FrameReader:
    """The API side of the core's pipe: length-prefixed pickles (write_frame), read from a
    non-blocking descriptor as they come. A message longer than what the pipe holds (the first,
    with the tokenizer) arrives over several wake-ups; nothing waits for its rest."""

    def __init__(self):
        self.buf = bytearray()

    def read(self, fd: int) -> tuple[list, bool]:
        """-> (every complete message now readable, whether the writer has closed its end)."""
        eof = False
        try:
            while chunk := os.read(fd, OUT_PIPE_BYTES):
                self.buf += chunk
            eof = True  # b"": the core's end is closed
        except BlockingIOError:  # nothing more for now
            pass
        except OSError:
            eof = True
        messages, pos, buf = [], 0, self.buf
        while len(buf) - pos >= 8:
            n = int.from_bytes(buf[pos : pos + 8], "little")
            if len(buf) - pos - 8 < n:
                break
            messages.append(pickle.loads(buf[pos + 8 : pos + 8 + n]))
            pos += 8 + n
        del buf[:pos]
        return messages, eof


def write_frame(fd: int, msg) -> None:
    """The core's side: one message, pickled, behind its length (blocking until all of it is written)."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view) :]


class EngineView:
    """What the API process needs of an engine that lives in another process, all fixed once it is
    built: the tokenizer, the limits, and LLMEngine.check_request itself (it reads only these)."""

    check_request = LLMEngine.check_request
    _check_kv_transfer = LLMEngine._check_kv_transfer  # (chapter 17: reads config.kv_transfer_config)

    def __init__(self, engine):
        self.tokenizer, self.config, self.max_model_len = engine.tokenizer, engine.config, engine.max_model_len
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=engine.model.config.vocab_size))
        self.block_manager = _Pool(engine.block_manager.num_blocks, engine.block_manager.block_size)
        self.sizes = SimpleNamespace(device=engine.sizes.device)
        self.groups: dict = {}  # request ids are the API process's to keep unique (AsyncLLMEngine does)
        # check_request validates grammars here (the API process): a manager of its own, same backend
        self.structured = StructuredOutputManager(engine.tokenizer, engine.model.config.vocab_size,
                                                  engine.eos_token_ids, engine.config.structured_outputs_backend)
        self.lora = None  # adapters are read and checked in the core's process (LLMEngine.add_checked)
        # what an adapter must fit (chapter 16): the API side checks one loaded at run time against it
        self.lora_targets = engine.lora.targets if engine.lora is not None else None


class _Pool:
    """The block pool's size, for check_request's "can it ever fit" (BlockManager's arithmetic)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size

    blocks_needed = BlockManager.blocks_needed
    max_blocks_held = BlockManager.max_blocks_held  # (no eviction policy here: every block counts)


def run_core_process(make_engine, warm_up, cmd_conn, out_conn, log_level: int) -> None:
    """The child process: build the engine, then serve the commands that come down the pipe."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the whole process group: the API process decides
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_read_commands, args=(cmd_conn, commands), name="minillm-core-reader", daemon=True).start()

    out_fd = out_conn.fileno()
    os.set_blocking(out_fd, True)

    def send(msg) -> None:
        try:
            write_frame(out_fd, msg)
        except OSError:  # the API process is gone: stop, aborting everything
            commands.put(("stop", True))

    try:
        engine, warm_up_seconds = build_engine(make_engine, warm_up)
    except Exception as e:
        logging.getLogger(__name__).exception("building the engine failed")
        send(("load_error", f"{type(e).__name__}: {e}"))
        return
    send(("ready", EngineView(engine), warm_up_seconds))  # written here: nothing runs yet that could change it
    writer = Writer(send, lambda: commands.put(("stop", True)))
    core = EngineCore(engine, commands, lambda rows, load: writer.put(("out", rows, load)),
                      lambda reason: writer.put(("dead", reason)))
    try:
        if core.run() is None:
            engine.shutdown()
    finally:
        writer.close()  # every message out, in order, before the pipe closes
        out_conn.close()


class Writer:
    """The core's messages out, pickled and written by a thread of their own, in order. The pickling
    and the pipe write of one step's rows then overlap the next step (its wait for the GPU lets go
    of the GIL), and a full pipe (an API loop some steps behind) never holds the engine back. What
    is put is never changed after: rows are fresh tuples, lists and strings."""

    def __init__(self, send, on_error):
        """send(msg) pickles and writes one message; on_error() is called (once) if one cannot be."""
        self.send, self.on_error, self.queue = send, on_error, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="minillm-core-writer", daemon=True)
        self.thread.start()

    def put(self, msg) -> None:
        self.queue.put(msg)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        failed = False
        while (msg := self.queue.get()) is not None:
            if failed:
                continue
            try:
                self.send(msg)
            except Exception as e:  # a message that does not pickle: a bug, which the API process must hear
                logging.getLogger(__name__).exception("the engine core could not send a message")
                failed = True
                self.send(("dead", f"the engine core could not send its output: {type(e).__name__}: {e}"))
                self.on_error()


def _read_commands(conn, commands: queue.Queue) -> None:
    """The child's reader thread: every command list into the queue, at once (the API process's
    writes never wait for a step). End-of-file: the API process is gone."""
    try:
        while True:
            for cmd in conn.recv():
                commands.put(cmd)
    except (EOFError, OSError):
        commands.put(("stop", True))
