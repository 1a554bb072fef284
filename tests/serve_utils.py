"""Helpers for the server tests: a tiny chat model, the real `minillm serve` in a subprocess on a free
port of 127.0.0.1 (every wait bounded), /metrics read back as numbers, a process's children, and
engine factories that pickle (an engine core process builds its engine from one) and fail on purpose."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
from tiny_models import make_tiny

# A ChatML-like template around the tiny tokenizer's one special token
CHAT_TEMPLATE = ("{% for m in messages %}<|end|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|end|>assistant\n{% endif %}")


CONTEXT = 4096  # long enough that a stream outlasts the test's reaction to it (about 2 ms a token on a CPU)


def make_tiny_chat_model(folder: Path) -> Path:
    make_tiny("llama3", folder, max_position_embeddings=CONTEXT)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.v1 = f"{self.base}/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.base}/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once nothing runs, waits or holds a KV block (every request before has ended).
        Idle on two scrapes in a row: the engine thread publishes its load just before it hands the
        last outputs to the event loop, which counts them, so the first idle scrape may precede that."""
        deadline, idle = time.monotonic() + timeout, False
        while True:
            m = self.metrics()
            if m["minillm_num_requests_running"] == m["minillm_num_requests_waiting"] == 0 \
                    and m["minillm_kv_cache_used_blocks"] == 0:
                if idle:
                    return m
                idle = True
                time.sleep(0.02)
                continue
            idle = False
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {m}")
            time.sleep(0.05)


@contextlib.contextmanager
def healthy(cmd: list[str], name: str, port: int, log: Path, env: dict | None = None, start_timeout: float = 120.0):
    """Run cmd (a server on port) until the block ends; yields a Server once /health says 200."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{server.output()}")
            try:
                if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {start_timeout} s:\n{server.output()}")
            time.sleep(0.2)
        yield server
    finally:
        stop(proc)


@contextlib.contextmanager
def serve(model: Path, *flags: str, log_dir: Path, env: dict | None = None, start_timeout: float = 120.0):
    """Run `minillm serve` until the block ends; yields a Server once /health says 200."""
    port = free_port()
    # one intra-op thread: tiny models gain nothing from more, and the machine has two cores to share
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", str(model), "--device", "cpu",
           "--port", str(port), "--no-access-log", *flags]
    with healthy(cmd, "minillm serve", port, log_dir / f"serve-{port}.log", env, start_timeout) as server:
        yield server


@contextlib.contextmanager
def router(prefill: str, decode: str, log_dir: Path, start_timeout: float = 60.0):
    """Run `minillm router` in front of a producer and a consumer; yields its Server."""
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "router", "--prefill", prefill, "--decode", decode, "--port", str(port)]
    with healthy(cmd, "minillm router", port, log_dir / f"router-{port}.log", start_timeout=start_timeout) as server:
        yield server


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it has not ended in time; -> its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label="v",...}": value}, and plain names for unlabelled series."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def total(metrics: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label values."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def children(pid: int) -> list[int]:
    """The pids whose parent is pid (an engine core process of a server), from /proc."""
    out = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(proc.name))
    return out


def gone(pid: int, timeout: float = 10.0) -> bool:
    """True once pid has ended (no process, or a zombie nobody reaped yet), within the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


# ---- engine factories for AsyncLLMEngine (module-level, so they pickle into an engine core process) ----

def build_engine(folder: str, **engine_args):
    from minillm import LLM

    return LLM(folder, device="cpu", **engine_args).engine


def engine_factory(folder) -> partial:
    return partial(build_engine, str(folder))


def no_model():
    raise FileNotFoundError("no model here")


def failing_steps(folder: str, fail: tuple[int, ...]):
    """An engine whose step calls number `fail` (1-based) raise: a bug outside any one request."""
    engine = build_engine(folder)
    real, calls = engine.step, iter(range(1, 10**9))

    def step(*args, **kwargs):
        if next(calls) in fail:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    engine.step = step
    return engine


POISON = 7  # a prompt that holds this token id fails its forward pass (poisoned_forward)


def poisoned_forward(folder: str):
    """An engine whose forward pass raises when a scheduled sequence's prompt holds POISON: a step
    failure that concerns the requests of that step only."""
    engine = build_engine(folder)
    executor, real, schedule = engine.executor, engine.executor.execute_model, engine.scheduler.schedule
    scheduled = []

    def schedule_and_remember():
        sched = schedule()
        scheduled[:] = [seq for seq, _ in sched.scheduled]
        return sched

    def execute(step):
        if any(POISON in seq.prompt_ids for seq in scheduled):
            raise RuntimeError("injected forward failure")
        return real(step)

    engine.scheduler.schedule = schedule_and_remember
    executor.execute_model = execute
    return engine


# ---- an in-process server (FastAPI's TestClient) on a tiny model whose EOS is a special token ------

def make_tiny_eos_model(folder: Path, template: str = CHAT_TEMPLATE) -> Path:
    """The tiny chat model with EOS = its special token <|end|> (id 319): the default EOS, id 2, is the
    plain byte 0x02, whose text would end every output that stops (structured-output tests compare
    whole texts)."""
    make_tiny("llama3", folder, max_position_embeddings=CONTEXT, eos_token_id=319)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@contextlib.contextmanager
def app_client(folder, engine_core: str = "thread", **engine_args):
    """An in-process server on `folder` (a TestClient), once /health says 200; engine_args go to LLM."""
    from fastapi.testclient import TestClient

    from minillm.engine.async_llm_engine import AsyncLLMEngine
    from minillm.entrypoints.openai.api_server import build_app

    app = build_app(AsyncLLMEngine(partial(build_engine, str(folder), **engine_args), engine_core=engine_core), "tiny")
    with TestClient(app, raise_server_exceptions=False) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield http
