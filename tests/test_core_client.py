"""The engine core's clients (core_client.py) against a front that has nothing but the five callbacks
a client reports through: a client that read or set any other attribute of its front would fail here.
In a thread and in a process alike: the rows handed to on_core_output carry LLM.generate's greedy
tokens; the loop-side callbacks run on the event loop's thread; a stop that was asked for ends with
on_core_ended(None); an engine that cannot be built is reported once, by on_core_load_failed, and
nothing after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from serve_utils import engine_factory, no_model

from minillm import LLM, SamplingParams
from minillm.engine.core_client import InprocClient, MPClient

CLIENTS = {"thread": InprocClient, "process": MPClient}


@pytest.fixture(scope="module")
def folder(tiny_chat_model):
    return tiny_chat_model


class Front:
    """The five callbacks and nothing else (__slots__: no attribute can be added from outside)."""

    __slots__ = ("events", "loop_thread", "off_loop", "rows", "settled")

    def __init__(self):
        self.events, self.rows, self.off_loop = [], [], []
        self.loop_thread = threading.get_ident()
        self.settled = threading.Event()  # ready, or failed to load

    def _on_loop(self, name):
        if threading.get_ident() != self.loop_thread:
            self.off_loop.append(name)

    def on_core_ready(self, engine, warm_up_seconds):
        self.events.append("ready")
        self.settled.set()

    def on_core_load_failed(self, reason):
        self.events.append(("load_failed", reason))
        self.settled.set()

    def on_core_output(self, rows, load):
        self._on_loop("on_core_output")
        self.rows += rows

    def on_core_dying(self, reason):
        self.events.append(("dying", reason))

    def on_core_ended(self, reason):
        self._on_loop("on_core_ended")
        self.events.append(("ended", reason))


async def _until(predicate, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("core", list(CLIENTS))
def test_a_client_reports_through_the_five_callbacks(folder, core):
    oracle = LLM(str(folder), device="cpu")
    prompts = [oracle.tokenizer.encode(p) for p in ("Hello there", "The sky is")]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in oracle.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]

    async def main():
        front = Front()
        client = CLIENTS[core](engine_factory(folder), False, front)
        client.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(front.settled.wait, 60)
        for i, ids in enumerate(prompts):
            client.send(("add", f"r{i}", ids, params, time.perf_counter()))
        await _until(lambda: sum(row[1] for row in front.rows) == len(prompts))
        client.send(("stop", False))
        await client.join(10)
        await _until(lambda: front.events[-1] == ("ended", None), 10)
        return front

    front = asyncio.run(main())
    got = {}
    for rid, _finished, error, _metrics, outs in front.rows:
        assert error is None
        for o in outs:
            got[rid] = got.get(rid, []) + list(o[2])
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert front.events == ["ready", ("ended", None)]
    assert front.off_loop == []


@pytest.mark.parametrize("core", list(CLIENTS))
def test_a_load_failure_is_reported_once(core):
    async def main():
        front = Front()
        client = CLIENTS[core](no_model, False, front)
        client.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(front.settled.wait, 60)
        await client.join(10)
        await asyncio.sleep(0.2)  # anything the client would still say arrives now
        return front

    front = asyncio.run(main())
    assert front.events == [("load_failed", "FileNotFoundError: no model here")]
