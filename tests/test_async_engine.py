"""AsyncLLMEngine in-process (no HTTP), on a tiny random checkpoint: the deltas of concurrent requests
put back together equal LLM.generate's outputs token for token; every request ends exactly once; an
abort frees the request's blocks; a failing step ends only its requests with finish_reason "error"
and the engine keeps serving; a bad request is refused before it is queued; shutdown aborts what is
in flight. The main ones run twice: the engine core in a thread, and in a process of its own (whose
death ends every open stream with an error). Every wait is bounded."""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import queue
import random
import signal
import threading
import time
from functools import partial

import pytest
import torch
from serve_utils import CONTEXT, engine_factory, failing_steps, no_model

from minillm import LLM, SamplingParams
from minillm.engine.async_llm_engine import AsyncLLMEngine, EngineNotReady, FinishedStats, outputs_of
from minillm.engine.core_process import OUT_PIPE_BYTES, FrameReader, write_frame

CORES = ["thread", "process"]


@pytest.fixture(scope="module")
def folder(tiny_chat_model):
    return tiny_chat_model


@pytest.fixture(scope="module")
def oracle(folder):
    return LLM(str(folder), device="cpu")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(folder, body, timeout: float = 60.0, make=None, on_finished=None, core: str = "thread"):
    """Start an AsyncLLMEngine on the folder's model, run `body(engine)` in its loop, shut it down."""
    async def main():
        engine = AsyncLLMEngine(make or engine_factory(folder), on_finished=on_finished, engine_core=core)
        engine.start()
        try:
            assert await asyncio.to_thread(engine.wait_ready, timeout)
            return await asyncio.wait_for(body(engine), timeout)
        finally:
            await engine.shutdown(timeout=10)

    return asyncio.run(main())


async def drain(engine, requests):
    """Every delta of the requests, and the outputs put back together per request."""
    deltas, text, ids, finished = [], {}, {}, {}
    async for d in engine.stream(requests):
        deltas.append(d)
        assert d.request_id not in finished, "a delta after the request's last one"
        for o in d.outputs:
            key = (d.request_id, o.index)
            text[key] = text.get(key, "") + o.text
            ids[key] = ids.get(key, []) + o.token_ids
        if d.finished:
            finished[d.request_id] = d
    return deltas, text, ids, finished


@pytest.mark.parametrize("core", CORES)
def test_deltas_equal_generate(folder, oracle, core):
    tok = oracle.tokenizer
    prompts = [tok.encode(p) for p in ["hello there", "the cat", "a b c d e", "one more prompt", "x"]]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=10),
              SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=9, logprobs=2),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=1.0, top_p=0.8, seed=11, max_tokens=8, n=3)]
    want = oracle.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    _, text, ids, finished = run(folder, lambda engine: drain(engine, requests), core=core)
    assert sorted(finished) == sorted(rid for rid, _, _ in requests)
    for i, w in enumerate(want):
        out = finished[f"r{i}"]
        assert isinstance(out.metrics, FinishedStats) and out.metrics.num_prompt_tokens == len(prompts[i])
        assert out.metrics.output_lens == tuple(len(c.token_ids) for c in w.outputs)
        for c in w.outputs:
            assert ids[(f"r{i}", c.index)] == c.token_ids, (i, c.index)
            assert text[(f"r{i}", c.index)] == c.text


def test_stop_string_never_streamed(folder, oracle):
    tok = oracle.tokenizer
    prompt = tok.encode("the cat sat")
    plain = oracle.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = next(plain[i : i + 2] for i in range(3, len(plain) - 2) if plain[i : i + 2].isascii()
                and plain[i : i + 2].strip() and plain[i : i + 2] not in plain[: i + 1])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = oracle.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    deltas, text, _, _ = run(folder, lambda engine: drain(engine, [("s", prompt, params)]))
    assert want.finish_reason == "stop" and want.stop_reason == stop
    assert text[("s", 0)] == want.text and stop not in text[("s", 0)]
    assert deltas[-1].outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize("core", CORES)
def test_abort_frees_blocks_and_engine_goes_on(folder, oracle, core):
    prompt = oracle.tokenizer.encode("hello")
    long = SamplingParams(temperature=0, max_tokens=CONTEXT - 10, ignore_eos=True)

    async def body(engine):
        events = []
        gen = engine.generate("long", prompt, long)
        first = await gen.__anext__()  # it runs: it holds blocks
        events.append(len(first.outputs[0].token_ids))
        await gen.aclose()  # the client went away
        deadline = time.monotonic() + 20
        while engine.load.used_blocks or engine.load.running or engine.load.waiting:
            assert time.monotonic() < deadline, engine.load
            await asyncio.sleep(0.01)
        _, _, ids, finished = await drain(engine, [("next", prompt, SamplingParams(temperature=0, max_tokens=5))])
        return events, ids, finished

    finished_reasons, built = [], []

    def make():  # thread mode: the engine itself is looked at afterwards
        built.append(LLM(str(folder), device="cpu").engine)
        return built[0]

    events, ids, finished = run(folder, body, make=make if core == "thread" else None, core=core,
                                on_finished=lambda out: finished_reasons.append(out.metrics.finish_reason))
    assert events[0] >= 1 and finished["next"].finished
    want = oracle.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert ids[("next", 0)] == want[0].outputs[0].token_ids
    assert finished_reasons == ["abort", "length"]
    if core == "thread":
        assert built[0].block_manager.num_used_blocks == 0 and not built[0].groups


def test_stream_batches_queue_at_once_and_abort_when_dropped_unread(folder, oracle):
    """The server queues a streamed request before its response starts; a response that never starts
    (its client left first) drops the stream unread, and that must abort the request."""
    prompt = oracle.tokenizer.encode("hello")
    long = SamplingParams(temperature=0, max_tokens=CONTEXT - 10, ignore_eos=True)

    async def body(engine):
        stream = engine.stream_batches([("dropped", prompt, long)])  # queued now, never read
        deadline = time.monotonic() + 20
        while not engine.load.running:  # it runs without anyone reading it
            assert time.monotonic() < deadline, engine.load
            await asyncio.sleep(0.01)
        del stream  # garbage: RequestStream.__del__ aborts it
        while engine.load.used_blocks or engine.load.running or engine.load.waiting:
            assert time.monotonic() < deadline, engine.load
            await asyncio.sleep(0.01)
        batches = [b async for b in engine.stream_batches([("read", prompt, SamplingParams(max_tokens=3))])]
        return batches

    reasons = []
    batches = run(folder, body, on_finished=lambda out: reasons.append((out.request_id, out.metrics.finish_reason)))
    assert reasons == [("dropped", "abort"), ("read", "length")]
    assert batches[-1][-1].finished and sum(len(d.outputs[0].token_ids) for b in batches for d in b) == 3


@pytest.mark.parametrize("core", CORES)
def test_failed_step_ends_only_its_request(folder, oracle, core):
    prompt = oracle.tokenizer.encode("the cat")
    params = SamplingParams(temperature=0, max_tokens=6)

    async def body(engine):  # the engine's second step raises (a bug outside any one request)
        _, _, _, first = await drain(engine, [("a", prompt, params), ("b", prompt, params)])
        _, _, ids, second = await drain(engine, [("c", prompt, params)])
        return first, ids, second, engine.load.used_blocks

    first, ids, second, used = run(folder, body, make=partial(failing_steps, str(folder), (2,)), core=core)
    for rid in "ab":
        assert first[rid].outputs[-1].finish_reason == "error"
        assert "injected step failure" in first[rid].error
    assert second["c"].error is None and used == 0
    want = oracle.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert ids[("c", 0)] == want


@pytest.mark.parametrize("core", CORES)
def test_bad_requests_refused_before_queueing(folder, core):
    async def body(engine):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.check("x", {"prompt_token_ids": [10**6]}, SamplingParams())
        with pytest.raises(ValueError, match="context"):
            engine.check("y", {"prompt_token_ids": [1] * CONTEXT}, SamplingParams())
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
        # one that skipped the check (a race, a bug): the engine refuses it, and its stream ends with why
        batches = [b async for b in engine.stream_batches([("unchecked", [10**6], SamplingParams(max_tokens=2))])]
        assert [d.outputs[0].finish_reason for b in batches for d in b] == ["error"]
        assert "outside the vocabulary" in batches[0][0].error
        _, _, _, finished = await drain(engine, [("ok", [1, 2, 3], SamplingParams(max_tokens=3))])
        return finished

    assert run(folder, body, core=core)["ok"].finished


@pytest.mark.parametrize("core", CORES)
def test_not_ready_load_error_and_shutdown(folder, core):
    async def main():
        dead = asyncio.Event()
        broken = AsyncLLMEngine(no_model, engine_core=core)
        with pytest.raises(EngineNotReady, match="loading"):
            broken.check_ready()
        broken.start(on_dead=dead.set)
        await asyncio.wait_for(dead.wait(), 30)
        assert not broken.ready and "no model here" in broken.load_error
        with pytest.raises(EngineNotReady, match="no model here"):
            broken.add_request("a", [1], SamplingParams())

        engine = AsyncLLMEngine(engine_factory(folder), engine_core=core)
        engine.start()
        assert await asyncio.to_thread(engine.wait_ready, 60) and engine.ready
        stream = engine.generate("long", [1, 2], SamplingParams(max_tokens=CONTEXT - 10, ignore_eos=True))
        await stream.__anext__()
        await asyncio.wait_for(engine.shutdown(10), 30)  # aborts what is in flight
        rest = [d async for d in stream]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        assert not engine.core.alive and not engine.ready
        with pytest.raises(EngineNotReady, match="shutting down"):
            engine.add_request("b", [1], SamplingParams())
        return engine, broken

    engine, broken = asyncio.run(main())
    if core == "process":  # both children ended on their own, and were reaped
        assert engine.core.proc.exitcode == 0 and broken.core.proc.exitcode == 0


def test_process_mode_needs_a_factory_that_pickles(folder):
    with pytest.raises(TypeError, match="engine_core='process' sends make_engine to a child process"):
        AsyncLLMEngine(lambda: LLM(str(folder), device="cpu").engine, engine_core="process")
    with pytest.raises(ValueError, match="engine_core must be one of thread, process, not 'fork'"):
        AsyncLLMEngine(engine_factory(folder), engine_core="fork")


def test_core_process_death_ends_streams_with_an_error(folder):
    """The engine core process is killed mid-stream: the stream ends with finish_reason "error",
    on_dead is called, the engine says why it is not serving, and new requests are refused."""
    async def main():
        dead = asyncio.Event()
        engine = AsyncLLMEngine(engine_factory(folder), engine_core="process")
        engine.start(on_dead=dead.set)
        try:
            assert await asyncio.to_thread(engine.wait_ready, 60)
            stream = engine.generate("long", [1, 2], SamplingParams(max_tokens=CONTEXT - 10, ignore_eos=True))
            await stream.__anext__()
            os.kill(engine.core.proc.pid, signal.SIGKILL)
            rest = await asyncio.wait_for(_all(stream), 30)
            await asyncio.wait_for(dead.wait(), 30)
            assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "error"
            assert "exited with code -9" in rest[-1].error and not engine.ready
            with pytest.raises(EngineNotReady, match="exited with code -9"):
                engine.check_ready()
            assert engine.core.proc.exitcode == -signal.SIGKILL
        finally:
            await asyncio.wait_for(engine.shutdown(10), 30)

    asyncio.run(main())


async def _all(stream):
    return [d async for d in stream]


def test_process_core_gets_each_request_as_its_handler_queues_it(folder):
    """In a burst, one pass of the event loop runs many requests' handlers back to back, each a
    millisecond or more of parsing and checking. Each add must leave for the engine core as its handler
    queues it, not when the pass ends: held to the end, it waited behind every other handler while the
    core stepped the few requests it had (scripts/serve_steps_cpu.py, 384 requests at rate inf on a
    2-core CPU: a median of 0.15-0.47 s between the API process taking a request in and the core
    getting it, and the running batch full after 164-288 steps instead of 76-102)."""
    n, handler_s = 6, 0.3

    async def body(engine):
        out: asyncio.Queue = asyncio.Queue()
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i in range(n):  # one pass of the loop: no await between the handlers
            engine.add_request(f"b{i}", [1, 2, 3], params, out)
            time.sleep(handler_s)  # the handler's work, holding the loop as parsing does
        pass_end = time.perf_counter()
        stats = {}
        while len(stats) < n:
            rid, finished, _, st, _ = await out.get()
            if finished:
                stats[rid] = st
        return pass_end, stats

    pass_end, stats = run(folder, body, core="process")
    assert stats["b0"].scheduled_time < pass_end, "the first request reached the core only after the whole pass"


def test_one_requests_prompts_reach_the_core_in_one_message_sharing_the_stop_list(folder, oracle):
    """A multi-prompt request's adds are pickled as one message, so the stop list that its prompts'
    params share (the server's check shares it) is written once and unpickled as one object in the
    core: sent one add at a time, 100,000 stops x 1024 prompts took the core from 2.5 to 8.4 GB
    (probe round 4, S1). The tokens are those of LLM.generate."""
    import copy
    import pickle

    stops = [f"zq{i:02d}" + "x" * 120 for i in range(64)]  # MAX_STOP_STRINGS, 7.9k of MAX_STOP_CHARS
    base = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=stops)
    tok = oracle.tokenizer
    prompts = [tok.encode(f"prompt number {i}") for i in range(16)]
    requests = [(f"s{i}", p, copy.copy(base)) for i, p in enumerate(prompts)]  # copies, one stop list
    sent: list[bytes] = []

    class Spy:  # the command pipe, recording what each message pickles to
        def __init__(self, conn):
            self.conn = conn

        def send(self, obj):
            sent.append(pickle.dumps(obj))
            self.conn.send(obj)

        def __getattr__(self, name):
            return getattr(self.conn, name)

    async def body(engine):
        engine.core._cmd_conn = Spy(engine.core._cmd_conn)
        return await drain(engine, requests)

    _, _, ids, finished = run(folder, body, core="process")
    adds = [m for m in map(pickle.loads, sent) if any(c[0] == "add" for c in m)]
    assert len(adds) == 1 and len(adds[0]) == len(prompts)
    received = [c[3] for c in adds[0]]
    assert all(p.stop is received[0].stop for p in received)
    one_list = len(pickle.dumps(stops))
    assert len(sent[0]) < one_list + 16 * 2000, (len(sent[0]), one_list)  # 16 copies: 16x one_list
    want = oracle.generate([{"prompt_token_ids": p} for p in prompts], base, use_tqdm=False)
    assert [ids[(f"s{i}", 0)] for i in range(len(prompts))] == [w.outputs[0].token_ids for w in want]
    assert sorted(finished) == sorted(rid for rid, _, _ in requests)


@pytest.mark.parametrize("core", CORES)
def test_heap_frozen_while_serving(folder, core):
    """Once the engine serves, the API process's heap (the imports, the tokenizer) is frozen, so a burst
    of requests sets off no full collection that walks it (~0.5 s each on a 2-core CPU, with the loop
    taking nothing in meanwhile: scripts/serve_steps_cpu.py); once it stops, it is collectable again
    (a dropped engine's GPU pool is freed only by the collector)."""
    async def body(engine):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        await _all(engine.generate("a", [1, 2, 3], params))
        return gc.get_freeze_count()

    assert run(folder, body, core=core) > 100_000  # the SmolLM2 tokenizer's vocabulary and merges alone
    assert gc.get_freeze_count() == 0


def test_command_pipe_holds_a_burst(folder):
    """The API process's commands go down a pipe the core's reader thread drains only when it gets its
    GIL from a step. At Linux's default 64 KiB, a burst of adds (~1.4 KB each at 300 prompt tokens)
    fills it after ~45 requests, and the event loop then waits in every write; widened, 384 fit."""
    async def body(engine):
        return fcntl.fcntl(engine.core._cmd_conn.fileno(), fcntl.F_GETPIPE_SZ)

    assert run(folder, body, core="process") >= OUT_PIPE_BYTES


def test_rows_merged_keep_every_stream(seed):
    """Random rows of random requests and choices (as the core sends them), read over random windows
    (a reader that fell behind), put back together equal the rows read one by one; a window gives one
    output per request, with its last row's end."""
    rng = random.Random(seed)
    rows = []
    for step in range(40):
        for rid in rng.sample(["a", "b", "c"], rng.randint(1, 3)):
            outs = [(i, rng.choice(["x", "yz", "", " é"]), [rng.randrange(100)], -float(step) if rid == "c" else None,
                     [{step: step}] if rid == "c" else None, None, None)
                    for i in sorted(rng.sample(range(3), rng.randint(1, 3)))]
            rows.append((rid, False, None, None, outs))
    last = rows[-1]
    rows[-1] = (last[0], True, None, "stats", last[4][:-1] + [last[4][-1][:5] + ("length", None)])
    prompts = {"a": [1], "b": [2, 3], "c": [4]}

    def put_together(batches):
        text, ids, lps, ends, cums = {}, {}, {}, {}, {}
        for batch in batches:
            assert len({d.request_id for d in batch}) == len(batch)
            for d in batch:
                assert d.prompt_token_ids == prompts[d.request_id]
                ends[d.request_id] = (d.finished, d.metrics)
                for o in d.outputs:
                    key = (d.request_id, o.index)
                    text[key] = text.get(key, "") + o.text
                    ids[key] = ids.get(key, []) + o.token_ids
                    lps[key] = lps.get(key, []) + (o.logprobs or [])
                    cums[key] = o.cumulative_logprob
                    if o.finish_reason:
                        ends[key] = o.finish_reason
        return text, ids, lps, ends, cums

    windows, i = [], 0
    while i < len(rows):
        n = rng.randint(1, 12)
        windows.append(outputs_of(rows[i : i + n], prompts.get))
        i += n
    one_by_one = [outputs_of([r], prompts.get) for r in rows]
    assert put_together(windows) == put_together(one_by_one)
    assert sum(map(len, windows)) < len(rows)
    assert put_together(one_by_one)[3][last[0]] == (True, "stats")


def test_frames_arrive_whole_over_many_reads(seed):
    """The core's messages through a real pipe read without blocking (as the event loop reads it):
    messages larger than the pipe (the first carries the tokenizer) come in pieces, small ones many
    to a read; each is read once, whole and in order, and the writer's close is seen."""
    rng = random.Random(seed)
    messages = [("out", [rng.randbytes(rng.choice([10, 5000, 3 << 20]))], i) for i in range(12)]
    r, w = os.pipe()
    os.set_blocking(r, False)

    def write():
        for m in messages:
            write_frame(w, m)
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    reader, got, eof, reads = FrameReader(), [], False, 0
    deadline = time.monotonic() + 30
    while not eof:
        assert time.monotonic() < deadline
        batch, eof = reader.read(r)
        got += batch
        reads += 1
        time.sleep(0.001)
    writer.join()
    os.close(r)
    assert got == messages and not reader.buf and reads > 1


def test_core_rows_only_what_a_step_can_change(folder, oracle, seed):
    """EngineCore with 2 sequences running and 8 requests held: each pass makes rows for the running
    and just-finished requests only (at most 2 looked at per pass, not all 8 held), and the rows put
    back together are LLM.generate's tokens."""
    from minillm.engine import engine_core

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(2, 6))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = LLM(str(folder), device="cpu", max_num_seqs=2).engine
    commands = queue.Queue()
    for i, ids in enumerate(prompts):
        commands.put(("add", f"r{i}", ids, params, 0.0))
    commands.put(("stop", False))
    looked, per_pass, tokens = [0], [], {}
    row = engine_core._Tracked.row

    def counted(self):
        looked[0] += 1
        return row(self)

    def publish(rows, load):
        per_pass.append(looked[0])
        looked[0] = 0
        for rid, _, error, _, outs in rows:
            assert error is None
            tokens[rid] = tokens.get(rid, []) + [t for o in outs for t in o[2]]

    engine_core._Tracked.row = counted
    try:
        assert engine_core.EngineCore(engine, commands, publish).run() is None
    finally:
        engine_core._Tracked.row = row
    want = oracle.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tokens == {f"r{i}": w.outputs[0].token_ids for i, w in enumerate(want)}
    assert max(per_pass) <= 2 and len(per_pass) >= 8 * 5 // 2
