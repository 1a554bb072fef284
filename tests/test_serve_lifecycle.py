"""The server's life around the requests: /health is 503 until the engine is built and warm; an API
key (flag or $MINILLM_API_KEY) guards /v1 with 401s; a model that fails to load ends `minillm serve`
with exit 2 and one line; SIGTERM ends in-flight streams cleanly (finish_reason "abort" after the
grace period, then `data: [DONE]`) and the process exits, leaving no child behind; `import minillm`
needs none of the server's packages. With the engine core in a process of its own (--engine-core
process), the same, and: its death makes /health a 503 that says why, and it exits when the server
is killed outright."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_utils import CONTEXT, POISON, children, engine_factory, gone, poisoned_forward, serve

from minillm import LLM

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "sk-test-0123456789"


def test_import_minillm_needs_no_server_packages():
    code = ("import sys, minillm, minillm.cli, minillm.engine.async_llm_engine, minillm.entrypoints.openai.cli_args\n"
            "minillm.cli.build_parser()\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'uvicorn', 'starlette', 'pydantic', "
            "'openai', 'prometheus_client'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_health_503_until_ready_and_api_key_flag(tiny_chat_model):
    """In process (FastAPI's TestClient): the engine's build waits on a gate, so the 503 is seen."""
    from fastapi.testclient import TestClient

    from minillm.engine.async_llm_engine import AsyncLLMEngine
    from minillm.entrypoints.openai.api_server import build_app

    gate = threading.Event()

    def make():
        assert gate.wait(60)
        return LLM(str(tiny_chat_model), device="cpu").engine

    app = build_app(AsyncLLMEngine(make), "tiny", api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        r = client.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@contextlib.contextmanager
def _healthy_client(app):
    """FastAPI's TestClient (the app in this process), once /health says 200."""
    from fastapi.testclient import TestClient

    with TestClient(app) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield http


@pytest.mark.parametrize("core", ["thread", "process"])
def test_engine_failure_is_a_500_or_an_error_event(tiny_chat_model, core):
    """A step that fails ends its request: unstreamed, a 500 with OpenAI's body; streamed (the 200 is
    sent already), an error event the openai client raises, then [DONE]. The next request is served.
    (The engine's forward pass fails on prompts that hold token POISON, wherever the engine runs.)"""
    from functools import partial

    from minillm.engine.async_llm_engine import AsyncLLMEngine
    from minillm.entrypoints.openai.api_server import build_app

    app = build_app(AsyncLLMEngine(partial(poisoned_forward, str(tiny_chat_model)), engine_core=core), "tiny")
    with _healthy_client(app) as http:
        poisoned = [POISON, 1, 2]
        r = http.post("/v1/completions", json={"prompt": poisoned, "max_tokens": 4})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "injected forward failure" in r.json()["error"]["message"]
        lines = [line for line in http.post("/v1/completions", json={
            "prompt": poisoned, "max_tokens": 4, "stream": True}).iter_lines() if line]
        assert "injected forward failure" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        with pytest.raises(openai.APIError, match="injected forward failure"):
            for _ in client.completions.create(model="tiny", prompt=poisoned, max_tokens=4, stream=True):
                pass
        ok = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
        assert ok.usage.completion_tokens == 4
        metrics = http.get("/metrics").text
        assert 'minillm_requests_total{finish_reason="error"} 3.0' in metrics


def test_core_process_death_makes_health_a_503(tiny_chat_model):
    """The engine core process is killed: /health and every /v1 call answer 503 saying why."""
    from minillm.engine.async_llm_engine import AsyncLLMEngine
    from minillm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine(engine_factory(tiny_chat_model), engine_core="process")
    with _healthy_client(build_app(engine, "tiny")) as http:
        os.kill(engine.core.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (r := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 503 and "engine core process exited with code -9" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert engine.core.proc.exitcode == -signal.SIGKILL


@pytest.mark.slow
def test_model_that_fails_to_load_exits_2(tmp_path):
    from serve_utils import free_port

    cmd = [sys.executable, "-m", "minillm", "serve", "--model", str(tmp_path / "missing"), "--device", "cpu",
           "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "minillm: error: the engine could not be built: FileNotFoundError" in out.stderr
    assert "Traceback" not in out.stderr.split("minillm: error:")[-1]
    bad_flag = subprocess.run([*cmd[:-2], "--block-size", "0"], capture_output=True, text=True, timeout=120)
    assert bad_flag.returncode == 2 and bad_flag.stderr.strip() == "minillm: error: block_size must be a positive int, not 0"


@pytest.fixture(scope="module", params=["thread", "process"])
def keyed_server(tiny_chat_model, tmp_path_factory, request):
    """API key from the environment; one sequence at a time, 1 s of grace at shutdown; the engine core
    in a thread, then in a process."""
    with serve(tiny_chat_model, "--max-num-seqs", "1", "--shutdown-grace", "1", "--engine-core", request.param,
               env={"MINILLM_API_KEY": KEY}, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {KEY}", KEY])
def test_missing_or_wrong_api_key_is_401(keyed_server, header):
    headers = {"Authorization": header} if header else {}
    for method, path in [("GET", "/models"), ("POST", "/completions"), ("POST", "/chat/completions")]:
        r = httpx.request(method, f"{keyed_server.v1}{path}", headers=headers, json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 401
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(f"{keyed_server.base}/health", timeout=10).status_code == 200  # open, for probes
    assert httpx.get(f"{keyed_server.base}/metrics", timeout=10).status_code == 200


def test_right_api_key_with_the_openai_client(keyed_server):
    with openai.OpenAI(base_url=keyed_server.v1, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai.OpenAI(base_url=keyed_server.v1, api_key=KEY, max_retries=0) as client:
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3


def test_sigterm_ends_streams_then_exits(keyed_server):
    """Three long chat streams (one runs, two wait: max-num-seqs 1); SIGTERM; after the 1 s grace
    each ends with finish_reason "abort" and [DONE], and the server exits. Runs last in this module."""
    body = {"model": str(keyed_server.proc.args[keyed_server.proc.args.index("--model") + 1]), "stream": True,
            "messages": [{"role": "user", "content": "go on"}], "max_tokens": CONTEXT - 100,
            "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main():
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            started = [asyncio.Event() for _ in range(3)]

            async def read(i):
                events = []
                async with http.stream("POST", f"{keyed_server.v1}/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started[i].set()
                return events

            readers = [asyncio.create_task(read(i)) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            kids.extend(children(keyed_server.proc.pid))
            t0 = time.monotonic()
            keyed_server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # within the 1 s grace: the streams still run
            try:  # a request during shutdown: refused (the socket is closed) or a 503, never served
                async with httpx.AsyncClient(timeout=10, headers=headers) as late:
                    r = await late.post(f"{keyed_server.v1}/chat/completions", json={**body, "stream": False})
                assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
            except httpx.ConnectError:
                pass
            assert not any(reader.done() for reader in readers)
            events = await asyncio.wait_for(asyncio.gather(*readers), 60)
            return events, time.monotonic() - t0

    kids = []
    events, seconds = asyncio.run(main())
    for stream in events:
        assert stream[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in stream[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finishes == ["abort"]
    assert seconds < 30
    assert keyed_server.proc.wait(60) == -signal.SIGTERM  # uvicorn re-raises the signal after its shutdown
    log = keyed_server.output()
    assert "Application shutdown complete" in log and "Traceback" not in log
    if "process" in keyed_server.proc.args:  # the engine core (and multiprocessing's helper) went with it
        assert kids
    assert all(gone(pid) for pid in kids), kids
    with pytest.raises(httpx.TransportError):  # nobody listens any more
        httpx.get(f"{keyed_server.base}/health", timeout=5)


def test_core_process_exits_when_the_server_is_killed(tiny_chat_model, tmp_path):
    """SIGKILL gives the server no chance to stop its engine core: the core sees its command pipe
    close, aborts what it runs and exits on its own (no orphan)."""
    with serve(tiny_chat_model, "--engine-core", "process", log_dir=tmp_path) as server:
        body = {"prompt": "go", "max_tokens": CONTEXT - 10, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.v1}/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: {")  # the core is busy with it
            kids = children(server.proc.pid)
            assert kids
            server.proc.kill()
            server.proc.wait(30)
        assert all(gone(pid, 30) for pid in kids), kids
