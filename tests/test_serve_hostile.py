"""The server against a hostile client, round 4 of the reliability probe
(../shared/research/reliability-probe-t4.md; issue 50).

In process (TestClient with raise_server_exceptions=True, so an error Starlette re-raises, which
uvicorn answers by dropping the connection, fails the test): the stop list and top_k are bounded; a
lone surrogate in `model` is a 404 and an unexpected error a 500, neither re-raised; prompts x n is
capped; a text too long for the context (or the request's token limit) is refused before it is
tokenized, and tokenizing stops at the limit or when the client leaves; many short chat messages
are rendered off the event loop, and /health answers while they render; a big non-streamed answer
is built off the loop, into the same JSON; a stream that fails ends with an error event and [DONE]; padded
token ids have no bytes; a request's prompts share one stop list; API keys no client could send are
refused. On 127.0.0.1 (slow): a head over --max-header-bytes is a 431, and a bad `model` keeps the
keep-alive connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest
from serve_utils import engine_factory, serve

from minillm import SamplingParams
from minillm.cli import main
from minillm.outputs import Logprob

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    from fastapi.testclient import TestClient

    from minillm.engine.async_llm_engine import AsyncLLMEngine
    from minillm.entrypoints.openai.api_server import build_app

    app = build_app(AsyncLLMEngine(engine_factory(tiny_chat_model)), "tiny", max_prompts=64, max_prompt_tokens=2000,
                    max_seqs=8)
    with TestClient(app) as http:  # raise_server_exceptions: a re-raised error fails the test
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield http, app


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _post(http, path: str, body: dict):
    """JSON as Python writes it (a lone surrogate travels as the escape \\ud800)."""
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _serving(app, kind: str = "completion"):
    from minillm.entrypoints.openai.serving_chat import OpenAIServingChat
    from minillm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    cls = OpenAIServingCompletion if kind == "completion" else OpenAIServingChat
    kwargs = dict(max_prompts=64, max_prompt_tokens=2000, max_seqs=8) if kind == "completion" else {}
    return cls(app.state.engine, "tiny", **kwargs)


def test_the_stop_list_and_top_k_are_bounded(served):
    http, _ = served
    e = _error(http.post("/v1/completions", json={"prompt": "hi", "stop": ["x"] * 65}), 400)
    assert e["param"] == "stop" and "at most 64" in e["message"]
    e = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "stop": ["y" * 5000, "z" * 5000]}), 400)
    assert e["param"] == "stop" and "10000 characters" in e["message"] and "at most 8192" in e["message"]
    e = _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 2**64}), 400)
    assert e["param"] == "top_k" and "at most" in e["message"]


def test_a_lone_surrogate_in_model_is_a_404_not_a_dropped_connection(served):
    http, _ = served
    for path, body in [("/v1/completions", {"model": "\ud800", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "x\udfff", "messages": [{"role": "user", "content": "hi"}]})]:
        e = _error(_post(http, path, body), 404)
        assert e["param"] == "model" and "\\ud" in e["message"]
    assert http.post("/v1/completions", json={"prompt": "still", "max_tokens": 2}).status_code == 200


def test_an_unexpected_error_is_a_500_that_is_not_re_raised(served, monkeypatch):
    http, _ = served
    from minillm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    async def broken(self, request, raw_request):
        raise RuntimeError("injected bug \ud800")

    monkeypatch.setattr(OpenAIServingCompletion, "create_completion", broken)
    e = _error(http.post("/v1/completions", json={"prompt": "x"}), 500)
    assert "injected bug \\ud800" in e["message"]


def test_prompts_times_n_is_capped(served):
    http, _ = served
    e = _error(http.post("/v1/completions", json={"prompt": [[1, 2]] * 3, "n": 3, "max_tokens": 1}), 400)
    assert e["param"] == "n" and e["code"] == "too_many_sequences"
    assert "3 prompts x n=3 = 9 sequences" in e["message"] and "at most 8" in e["message"]
    assert http.post("/v1/completions", json={"prompt": [[1, 2]] * 4, "n": 2, "max_tokens": 1}).status_code == 200


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(served, monkeypatch):
    http, app = served
    serving = _serving(app)
    tok = serving.tokenizer
    per_prompt = serving.max_chars(app.state.engine.engine.max_model_len)
    assert per_prompt is not None

    def encode(*args, **kwargs):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(tok, "encode", encode)
    monkeypatch.setattr(tok, "apply_chat_template", encode)
    e = _error(http.post("/v1/completions", json={"prompt": "a" * (per_prompt + 1)}), 400)
    assert e["code"] == "context_length_exceeded" and f"at most {per_prompt} characters" in e["message"]
    e = _error(http.post("/v1/completions", json={"prompt": ["a" * (serving.max_chars(2000) // 2 + 1)] * 2}), 400)
    assert e["code"] == "too_many_prompt_tokens" and "--max-prompt-tokens-per-request" in e["message"]
    e = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * per_prompt},
                                                                    {"role": "user", "content": "b"}]}), 400)
    assert e["param"] == "messages" and e["code"] == "context_length_exceeded"


def test_tokenizing_stops_at_the_token_limit_and_when_the_client_leaves(served, monkeypatch):
    _, app = served
    serving = _serving(app)
    calls = []

    def encode(text, **kwargs):
        calls.append(text)
        time.sleep(0.02)
        return [5] * 100

    monkeypatch.setattr(serving.tokenizer, "encode", encode)
    from minillm.entrypoints.openai.serving_engine import APIError

    with pytest.raises(APIError, match="2100 tokens in all") as e:  # 21 x 100 > 2000: the rest is not read
        serving._token_ids(["text"] * 60)
    assert e.value.code == "too_many_prompt_tokens" and len(calls) == 21

    class Leaving:  # the client leaves 0.1 s in
        async def receive(self):
            await asyncio.sleep(0.1)
            return {"type": "http.disconnect"}

    calls.clear()
    serving.max_prompt_tokens = 10**9
    with pytest.raises(APIError, match="closed the connection") as e:
        asyncio.run(serving._tokenize(["x" * 2000] * 60, Leaving()))
    assert e.value.status == 499
    time.sleep(0.2)
    assert len(calls) < 20, len(calls)  # 60 x 0.02 s had it gone on


def test_tokenizing_one_long_text_stops_at_its_budget(served, monkeypatch):
    """BPE itself is told the budget (the context, or what is left of the request's limit) and the
    stop hook: a text past it is a 400 after about the budget's work, not the whole text's."""
    http, app = served
    serving = _serving(app)
    max_len = app.state.engine.engine.max_model_len
    from minillm.entrypoints.openai.serving_engine import APIError

    text = "a b" * (max_len * 2)  # fits the characters' bound; past the context
    serving.max_prompt_tokens = 10**9
    with pytest.raises(APIError, match=f"longer than {max_len} tokens") as e:
        serving._token_ids([text])
    assert e.value.code == "context_length_exceeded"
    serving.max_prompt_tokens = max_len // 2  # now the request's limit is the nearer one
    with pytest.raises(APIError, match="--max-prompt-tokens-per-request") as e:
        serving._token_ids([[1] * (max_len // 4), text])
    assert e.value.code == "too_many_prompt_tokens"
    seen = []
    real = serving.tokenizer.encode
    monkeypatch.setattr(serving.tokenizer, "encode", lambda t, **kw: seen.append(kw) or real(t, **kw))
    serving._token_ids([[1] * 10, "hello"], threading.Event())
    assert seen[0]["max_tokens"] == max_len // 2 - 10 and callable(seen[0]["should_stop"])
    e = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}), 400)
    assert e["code"] == "context_length_exceeded" and f"longer than {max_len} tokens" in e["message"]


def test_many_short_chat_messages_are_rendered_off_the_event_loop(served, monkeypatch):
    http, app = served
    tok = app.state.engine.engine.tokenizer
    where = []
    render = tok.apply_chat_template

    def spy(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("thread")
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    few = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    many = {"messages": [{"role": "user", "content": ""}] * 200, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=few).status_code == 200
    assert http.post("/v1/chat/completions", json=many).status_code == 200
    assert where == ["loop", "thread"]


def test_health_answers_while_big_chat_renders_run(served, monkeypatch):
    """Eight 120,000-message chats froze /health for 14 s (probe round 4, M3). Each render here sleeps
    1.5 s (as a big render takes its time; a sleep costs the two cores nothing): /health must answer
    within 0.75 s while four of them run, as it cannot when they hold the event loop."""
    http, app = served
    tok = app.state.engine.engine.tokenizer
    render, running = tok.apply_chat_template, []

    def slow(conversation, **kwargs):
        running.append(1)
        try:
            time.sleep(1.5)
            return render(conversation[:1], **kwargs)  # one message's prompt: a short prefill
        finally:
            running.pop()

    monkeypatch.setattr(tok, "apply_chat_template", slow)
    many = {"messages": [{"role": "user", "content": ""}] * 70, "max_tokens": 1}  # off the loop by count
    threads = [threading.Thread(target=lambda: statuses.append(http.post("/v1/chat/completions", json=many).status_code))
               for _ in range(4)]
    statuses: list[int] = []
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not running:  # a render has begun
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t0 = time.perf_counter()
    assert http.get("/health").status_code == 200
    waited = time.perf_counter() - t0
    for t in threads:
        t.join(60)
    assert statuses == [200] * 4
    assert waited < 0.75, f"/health took {waited:.2f} s while chat templates rendered"


def _where() -> str:
    try:
        asyncio.get_running_loop()
        return "loop"
    except RuntimeError:
        return "thread"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_big_non_streamed_answer_is_built_off_the_event_loop(served, monkeypatch, path):
    """n=128 x 64 tokens x top-20 logprobs held the loop (and /health) for 6.5 s while its answer was
    built (probe round 4, m4): past INLINE_RESPONSE_ENTRIES logprob entries it is built and serialized
    in a worker thread, into the same JSON the loop would have sent."""
    http, _ = served
    import minillm.entrypoints.openai.serving_chat as chat_module
    import minillm.entrypoints.openai.serving_completion as completion_module
    from minillm.entrypoints.openai import serving_engine

    module, name = ((chat_module, "ChatCompletionResponse") if "chat" in path
                    else (completion_module, "CompletionResponse"))
    where, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        where.append(_where())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(serving_engine, "INLINE_RESPONSE_ENTRIES", 100)  # small answers, quick on 2 cores
    head = ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20} if "chat" in path
            else {"prompt": "hi", "logprobs": 20})
    big = {**head, "max_tokens": 4, "n": 2, "temperature": 0, "ignore_eos": True}  # 2 x 4 x 21 entries > 100
    small = {**head, "max_tokens": 2, "temperature": 0, "ignore_eos": True}  # 2 x 21 <= 100
    answers = [http.post(path, json=body) for body in (big, small)]
    assert [a.status_code for a in answers] == [200, 200] and answers[0].headers["content-type"] == "application/json"
    assert where == ["thread", "loop"]
    monkeypatch.setattr(serving_engine, "INLINE_RESPONSE_ENTRIES", 10**9)
    inline = http.post(path, json=big)
    assert where[-1] == "loop"
    strip = lambda r: {k: v for k, v in r.json().items() if k not in ("id", "created")}
    assert strip(answers[0]) == strip(inline)


def test_a_stream_that_fails_ends_with_an_error_event_and_done(served, monkeypatch):
    http, _ = served

    def broken(*args):
        raise IndexError("injected chunk bug")

    monkeypatch.setattr("minillm.entrypoints.openai.serving_completion.logprobs", broken)
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1,
                                                      "stream": True}) as r:
        body = "".join(r.iter_text())
    assert r.status_code == 200 and "injected chunk bug" in body and body.endswith("data: [DONE]\n\n"), body


def test_padded_token_ids_have_no_bytes(served):
    _, app = served
    chat = _serving(app, "chat")
    past = len(chat.tokenizer.vocab) + 3  # an embedding row past the tokenizer
    lp = chat._logprobs([past], [{past: Logprob(-0.5, 1, "")}], 1)
    assert lp.content[0].bytes == [] and lp.content[0].top_logprobs[0].bytes == []


def test_a_requests_prompts_share_one_stop_list(served):
    _, app = served
    requests = _serving(app).check("cmpl-x", [[1, 2], [3, 4], [5]], SamplingParams(stop=["a", "b"]), "prompt")
    assert all(p.stop is requests[0][2].stop for _, _, p in requests) and requests[0][2].stop == ["a", "b"]


@pytest.mark.parametrize("key", ["clé", " padded", "two words"])
def test_api_keys_no_client_can_send_are_refused(key, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["serve", "--api-key", key])
    assert "visible ASCII" in capsys.readouterr().err
    monkeypatch.setenv("MINILLM_API_KEY", key)
    assert main(["serve", "--port", "1"]) == 2  # refused before the engine is built or the port opens
    assert "$MINILLM_API_KEY must be visible ASCII" in capsys.readouterr().err


# ---- on 127.0.0.1 ----------------------------------------------------------------------------------


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ")[1]), rest


@pytest.mark.slow
def test_headers_are_bounded_and_a_bad_model_keeps_the_connection(tiny_chat_model, tmp_path):
    with serve(tiny_chat_model, "--max-header-bytes", "8192", "--api-key", "k3y", log_dir=tmp_path) as server:
        with contextlib.closing(socket.create_connection(("127.0.0.1", server.port), timeout=30)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            sent = 0
            with contextlib.suppress(OSError):  # the server may close while we still send
                while sent < 2**20:
                    sock.sendall(b"a" * 4096)
                    sent += 4096
                    if sent > 64 * 1024:
                        break
            status, body = _read_response(sock)
            assert status == 431 and b"8192 bytes" in body
        body = json.dumps({"model": "\ud800", "prompt": "hi", "max_tokens": 2}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k3y\r\nx-fine: " + b"b" * 4000
                   + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        with contextlib.closing(socket.create_connection(("127.0.0.1", server.port), timeout=30)) as sock:
            for _ in range(2):  # the same keep-alive connection answers both
                sock.sendall(request)
                status, answer = _read_response(sock)
                assert status == 404 and b"\\\\ud800" in answer, answer
        with contextlib.closing(socket.create_connection(("127.0.0.1", server.port), timeout=30)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _read_response(sock)[0] == 200
