"""`minillm bench serve`'s client (bench/serve.py): a burst of requests reaches the server at once, and
a server it cannot use is a one-line error. The server here is a stand-in (aiohttp.web, in a thread)
that holds every request until the whole burst has arrived, streaming to those already in: a client that lets requests out one by
one, as httpx 0.27's pool did, takes seconds to complete it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

web = pytest.importorskip("aiohttp.web")

from minillm.bench.serve import BenchRequest, ServerError, run_requests, run_requests_in_process  # noqa: E402

PROBE_TOKENS = 8  # run_requests' untimed first request asks for at most this many tokens


@contextmanager
def burst_server(burst: int, api_key: str | None = None, hold: float = 20.0):
    """A server that streams a token every 2 ms to each timed request until `burst` of them are in
    flight together, then ends them all (after `hold` seconds without the whole burst: an error
    event). The client's untimed test request gets one token at once. Yields (url, state)."""
    state = {"arrivals": [], "in_flight": 0, "peak": 0, "opened": set(), "found_open": 0}
    started = threading.Event()

    async def completions(request):
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        if body["max_tokens"] <= PROBE_TOKENS:  # the client's untimed test request
            return await _answer(request)
        state["arrivals"].append(time.perf_counter())
        state["found_open"] += id(request.transport) in state["opened"]  # its connection was opened before
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        if len(state["arrivals"]) == burst:
            state["all_in"].set()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:  # while the burst comes in, stream a token every 2 ms, as a busy server does
            deadline = time.perf_counter() + hold
            while not state["all_in"].is_set():
                if time.perf_counter() > deadline:
                    await response.write(b'data: {"error":{"message":"the burst never arrived"}}\n\n')
                    return response
                await response.write(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n')
                await asyncio.sleep(0.002)
        finally:
            state["in_flight"] -= 1
        return await _answer(request, response)

    async def _answer(request, response=None):
        if response is None:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n')
        await response.write(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request):
        state["opened"].add(id(request.transport))
        return web.Response()

    async def models(request):
        return web.json_response({"data": [{"id": "stand-in"}]})

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        state["all_in"] = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        loop.run_until_complete(site.start())
        state["port"] = site._server.sockets[0].getsockname()[1]
        state["loop"] = loop
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{state['port']}", state
    finally:
        state["loop"].call_soon_threadsafe(state["loop"].stop)
        thread.join(30)


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest([1, 2, 3], 3, PROBE_TOKENS + 1 + i % 5) for i in range(n)]


@pytest.mark.parametrize("in_process", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_burst_reaches_the_server_at_once(in_process):
    """128 requests at rate inf: all in the server at once, within 2 s (the aiohttp client: 0.1 s on a
    loaded 2-core machine; httpx 0.27's pool, this client before: 6 s for 96, and for 256 it failed
    178 after 26 s)."""
    burst = 128
    with burst_server(burst) as (url, state):
        if in_process:  # the client in a process of its own, as serve_overhead runs it
            results, _, model = run_requests_in_process(url, _requests(burst), progress=False)
        else:
            results, _, model = asyncio.run(run_requests(url, _requests(burst), progress=False))
    assert model == "stand-in"
    assert [r.error for r in results if not r.success] == []
    assert state["peak"] == burst  # every request of the burst was in the server at the same time
    spread = max(state["arrivals"]) - min(state["arrivals"])
    assert spread < 2.0, f"the burst reached the server over {spread:.2f} s"
    assert all(r.num_output_tokens == 1 and r.prompt_tokens == 3 for r in results)


def test_max_concurrency_caps_what_is_in_flight():
    """With --max-concurrency 8, no more than 8 are ever in the server (its burst never completes:
    every request streams until the stand-in's 1 s hold runs out, then ends with an error)."""
    with burst_server(burst=100, hold=1.0) as (url, state):
        results, _, _ = asyncio.run(run_requests(url, _requests(16), max_concurrency=8, progress=False))
    assert state["peak"] == 8
    assert all("the burst never arrived" in r.error for r in results)


def test_refused_key_and_dead_port_are_clear_errors():
    with burst_server(1, api_key="sesame") as (url, _):
        with pytest.raises(ServerError, match=r"HTTP 401 \(pass --api-key"):
            asyncio.run(run_requests(url, _requests(1), model="m", progress=False))
        results, _, _ = asyncio.run(run_requests(url, _requests(1), model="m", api_key="sesame", progress=False))
        assert results[0].success
    from serve_utils import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match="cannot reach a server at"):
        asyncio.run(run_requests(dead, _requests(1), progress=False))
    with pytest.raises(ServerError, match="did not answer a test request"):
        asyncio.run(run_requests(dead, _requests(1), model="m", progress=False))


@pytest.mark.slow
def test_dead_port_from_the_command_line():
    """One line on stderr, exit status 2, no traceback."""
    from serve_utils import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "minillm", "bench", "serve", "--base-url", dead, "--workload",
                           "prompts", "--num-prompts", "1", "--model", "m", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("minillm: error: the server at") and "did not answer" in proc.stderr


def test_serve_loop_bench_runs_and_loses_nothing():
    """`python -m minillm.bench.serve_loop` at a tiny size: every stream gets every token (it asserts
    that itself), at each lag, and the cost per token is a positive number."""
    from minillm.bench.serve_loop import run

    rows = run(streams=3, tokens=9, behind=(1, 4), repeat=1)
    assert [r["steps behind"] for r in rows] == [1, 4]
    assert all(r["loop CPU us/token"] > 0 and r["tokens"] == 27 for r in rows)


def test_a_burst_finds_its_connections_open():
    """At rate inf the client opens a connection per request before its clock starts, and every request
    of the burst goes out on one of them: no TCP handshake is inside the measured burst."""
    burst = 64
    with burst_server(burst) as (url, state):
        results, _, _ = asyncio.run(run_requests(url, _requests(burst), progress=False))
    assert [r.error for r in results if not r.success] == []
    assert len(state["opened"]) == burst
    assert state["found_open"] == burst
