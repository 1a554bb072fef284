"""A step trace of every engine in every process, for scripts/serve_steps_cpu.py (chapter 12).

    PYTHONPATH=scripts/serve_steps MINILLM_STEP_TRACE_DIR=/tmp/trace [MINILLM_EMULATE_STEP_US=500,3] \\
        [MINILLM_CORE_PROFILE=1] python ...

Python imports a sitecustomize at start-up, so this reaches the server, its spawned engine-core
process and the offline LLM.generate process alike, without a line of the engine changed (it works
unchanged on an older checkout: a before/after). It first runs scripts/emulate_gpu_step (which does
nothing unless MINILLM_EMULATE_STEP_US is set), then wraps four methods:

    LLMEngine.add_checked   when each request reached the engine (and, in the engine core, when the
                            API process took it in: the command's `arrival`)
    Scheduler.schedule      what each step runs: decoding sequences, prompt chunks and their tokens,
                            running and waiting after it
    LLMEngine.step          its wall time and the CPU of the stepping thread
    EngineCore._publish     the CPU of making each pass's rows (the core's work beside the step)

Each process that steps writes {dir}/{core|offline}-{pid}.jsonl, one line per busy period (from the
first request to the engine's going idle). With MINILLM_CORE_PROFILE set, the engine core runs under
cProfile and writes {dir}/core-{pid}.prof when it stops; each LLM.generate call writes
{dir}/offline-{pid}.prof (the last call's, the timed one, is what is left).
With MINILLM_API_PHASES=WARM,BURST (the API process: the server's event loop), the loop thread's CPU
and wall time are stamped at two moments, written to {dir}/api-{pid}.json: the WARM-th request
finishing (the warm-up is over) and the (WARM + BURST)-th request leaving for the core (the burst is
in: intake is over; streaming remains), with the garbage collector's pauses so far. With MINILLM_CORE_PROFILE set too, the loop runs under a
cProfile per phase: {dir}/api-{pid}-{intake|stream}.prof.
With MINILLM_SEND_PER_PASS set, the API process sends its commands to the core as it did before
2026-11-26: buffered until the event loop's current pass is over (the A/B of scripts/serve_steps_cpu.py
--send-per-pass). Without MINILLM_STEP_TRACE_DIR it does nothing beyond the emulation.
"""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "emulate_gpu_step", "sitecustomize.py"))

_DIR = os.environ.get("MINILLM_STEP_TRACE_DIR")

if _DIR:
    import cProfile
    import functools
    import json
    import threading
    import time

    from minillm.engine.engine_core import EngineCore
    from minillm.engine.llm_engine import LLMEngine
    from minillm.engine.scheduler import Scheduler

    _state = threading.local()  # the arrival of the "add" command being applied, in the core
    _trace = {"role": "offline", "adds": [], "steps": [], "publishes": [], "sched": None}

    def _flush() -> None:
        """One busy period, appended as a line: its adds and its steps."""
        if _trace["steps"] or _trace["adds"]:
            with open(os.path.join(_DIR, f"{_trace['role']}-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({k: _trace[k] for k in ("adds", "steps", "publishes")}) + "\n")
        _trace["adds"], _trace["steps"], _trace["publishes"] = [], [], []

    # where every request enters the engine: add_checked (add_request calls it; the core calls it
    # alone), or add_request on a checkout older than add_checked
    _ADD = "add_checked" if hasattr(LLMEngine, "add_checked") else "add_request"
    _add = getattr(LLMEngine, _ADD)

    @functools.wraps(_add)
    def add_request(self, request_id, *args, **kwargs):
        _add(self, request_id, *args, **kwargs)
        group = self.groups[request_id]
        # [reached the engine, the API process's arrival (core only), prompt tokens, max tokens]
        _trace["adds"].append([time.perf_counter(), getattr(_state, "arrival", None), len(group.prompt_ids),
                               group.seqs[0].params.max_tokens])

    _schedule = Scheduler.schedule

    @functools.wraps(_schedule)
    def schedule(self):
        out = _schedule(self)
        dec_seqs = dec_tok = pre_seqs = pre_tok = 0
        for seq, n in out.scheduled:
            if seq.num_computed_tokens >= len(seq.prompt_ids):  # its prompt is in the cache: decoding
                dec_seqs, dec_tok = dec_seqs + 1, dec_tok + n
            else:
                pre_seqs, pre_tok = pre_seqs + 1, pre_tok + n
        _trace["sched"] = [dec_seqs, dec_tok, pre_seqs, pre_tok, len(self.running), len(self.waiting)]
        return out

    _step = LLMEngine.step

    @functools.wraps(_step)
    def step(self, unfinished_outputs=True):
        t0, c0 = time.perf_counter(), time.thread_time()
        _trace["sched"] = None
        outs = _step(self, unfinished_outputs)
        t1, c1 = time.perf_counter(), time.thread_time()
        # [began, ended, CPU of this thread, decoding seqs, their tokens, prompt-chunk seqs, their tokens,
        #  running, waiting] (the last six None: the step scheduled nothing)
        _trace["steps"].append([t0, t1, c1 - c0, *(_trace["sched"] or [None] * 6)])
        if _trace["role"] == "offline" and not self.has_unfinished_requests():
            _flush()
        return outs

    _apply = EngineCore._apply

    @functools.wraps(_apply)
    def apply(self, cmd):
        _trace["role"] = "core"
        _state.arrival = cmd[4] if cmd[0] == "add" else None
        try:
            return _apply(self, cmd)
        finally:
            _state.arrival = None

    _publish = EngineCore._publish

    @functools.wraps(_publish)
    def publish(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        _publish(self)
        _trace["publishes"].append([t0, time.thread_time() - c0])  # [began, CPU of this thread]
        if not self.engine.has_unfinished_requests():  # the core's busy period ends with this pass's rows
            _flush()

    setattr(LLMEngine, _ADD, add_request)
    Scheduler.schedule, LLMEngine.step = schedule, step
    EngineCore._apply, EngineCore._publish = apply, publish

    if os.environ.get("MINILLM_SEND_PER_PASS"):  # the API process's commands as before 2026-11-26, for an A/B
        from minillm.engine.core_client import MPClient

        def send_per_pass(self, cmd):
            """Buffered, and sent when the event loop's current pass is over (whatever it runs first)."""
            self._pending.append(cmd)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.front.call_soon(self._flush)

        MPClient.send = send_per_pass

    if os.environ.get("MINILLM_CORE_PROFILE"):
        from minillm.llm import LLM

        _run = EngineCore.run

        @functools.wraps(_run)
        def run(self):
            prof = cProfile.Profile()
            prof.enable()
            try:
                return _run(self)
            finally:
                prof.disable()
                prof.dump_stats(os.path.join(_DIR, f"core-{os.getpid()}.prof"))

        _generate = LLM.generate

        @functools.wraps(_generate)
        def generate(self, *args, **kwargs):
            prof = cProfile.Profile()
            prof.enable()
            try:
                return _generate(self, *args, **kwargs)
            finally:
                prof.disable()
                prof.dump_stats(os.path.join(_DIR, f"offline-{os.getpid()}.prof"))

        EngineCore.run, LLM.generate = run, generate

    if os.environ.get("MINILLM_API_PHASES"):  # the server's event loop: intake, then streaming
        import gc

        from minillm.engine.async_llm_engine import AsyncLLMEngine

        _warm, _burst = map(int, os.environ["MINILLM_API_PHASES"].split(","))
        _api = {"adds": 0, "finished": 0, "phase": None, "prof": None, "marks": [], "gc": [0.0, 0, 0, 0], "gc_t0": 0.0}

        def _gc_timer(event: str, info: dict) -> None:
            """The garbage collector's pauses: [seconds, collections of generation 0, 1, 2]."""
            if event == "start":
                _api["gc_t0"] = time.perf_counter()
            else:
                _api["gc"][0] += time.perf_counter() - _api["gc_t0"]
                _api["gc"][1 + info["generation"]] += 1

        gc.callbacks.append(_gc_timer)
        _profile_api = bool(os.environ.get("MINILLM_CORE_PROFILE"))

        def _api_phase(name: str | None) -> None:
            """End the phase running (its profile written), and begin `name` (None: the server stops)."""
            _api["marks"].append([_api["phase"], time.perf_counter(), time.thread_time(), *_api["gc"]])
            if _api["prof"] is not None:
                _api["prof"].disable()
                _api["prof"].dump_stats(os.path.join(_DIR, f"api-{os.getpid()}-{_api['phase']}.prof"))
            _api["phase"], _api["prof"] = name, None
            if name is not None and _profile_api:
                _api["prof"] = cProfile.Profile()  # this thread only: the event loop's
                _api["prof"].enable()
            if name is None:  # [[phase ended, perf_counter, thread CPU, GC seconds, GC collections by
                # generation], ...] (the GC's: since the process began), the first the warm-up's end
                with open(os.path.join(_DIR, f"api-{os.getpid()}.json"), "w") as f:
                    json.dump(_api["marks"], f)

        _front_add = AsyncLLMEngine.add_request

        @functools.wraps(_front_add)
        def front_add(self, *args, **kwargs):
            out = _front_add(self, *args, **kwargs)
            _api["adds"] += 1
            if _api["adds"] == _warm + _burst and _api["phase"] == "intake":
                _api_phase("stream")
            return out

        _deliver = AsyncLLMEngine.deliver

        @functools.wraps(_deliver)
        def deliver(self, rows):
            _deliver(self, rows)
            _api["finished"] += sum(1 for row in rows if row[1])
            if _api["phase"] is None and not _api["marks"] and _api["finished"] >= _warm:
                _api_phase("intake")

        _front_shutdown = AsyncLLMEngine.shutdown

        @functools.wraps(_front_shutdown)
        async def front_shutdown(self, *args, **kwargs):
            if _api["phase"] is not None:
                _api_phase(None)
            return await _front_shutdown(self, *args, **kwargs)

        AsyncLLMEngine.add_request, AsyncLLMEngine.deliver, AsyncLLMEngine.shutdown = front_add, deliver, front_shutdown

        # the wire, server side: when uvicorn accepted each connection and finished parsing each request
        # (httptools), so a late arrival can be told apart from a late request: written with the marks
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        _wire = {"accepted": [], "parsed": []}
        _made, _complete = HttpToolsProtocol.connection_made, HttpToolsProtocol.on_message_complete

        def connection_made(self, transport):
            _wire["accepted"].append(time.perf_counter())
            return _made(self, transport)

        def on_message_complete(self):
            _wire["parsed"].append(time.perf_counter())
            return _complete(self)

        HttpToolsProtocol.connection_made, HttpToolsProtocol.on_message_complete = connection_made, on_message_complete
        _api_phase_marks = _api_phase

        def _api_phase(name):  # the same, and the wire stamps written beside the marks at the end
            _api_phase_marks(name)
            if name is None:
                with open(os.path.join(_DIR, f"wire-api-{os.getpid()}.json"), "w") as f:
                    json.dump(_wire, f)

    if os.environ.get("MINILLM_CLIENT_WIRE"):  # the benchmark client: when each request's connection was
        # open and when its bytes were written (aiohttp), against its `start` stamp
        import aiohttp.client_reqrep
        import aiohttp.connector

        import minillm.bench.serve as _bench_serve

        _cwire = {"connected": [], "written": []}
        _create, _send = aiohttp.connector.TCPConnector._create_connection, aiohttp.client_reqrep.ClientRequest.send

        async def _create_connection(self, req, traces, timeout):
            out = await _create(self, req, traces, timeout)
            _cwire["connected"].append(time.perf_counter())
            return out

        async def _send_req(self, conn):
            out = await _send(self, conn)
            _cwire["written"].append(time.perf_counter())
            return out

        aiohttp.connector.TCPConnector._create_connection = _create_connection
        aiohttp.client_reqrep.ClientRequest.send = _send_req
        _run_requests = _bench_serve.run_requests

        async def run_requests(*args, **kwargs):
            _cwire["connected"].clear(), _cwire["written"].clear()  # the warm-up request's
            out = await _run_requests(*args, **kwargs)
            with open(os.path.join(_DIR, f"wire-client-{os.getpid()}.json"), "w") as f:
                json.dump(_cwire, f)
            return out

        _bench_serve.run_requests = run_requests
