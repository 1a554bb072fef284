"""Chapter 17 through HTTP: two `minillm serve` processes (a producer and a consumer of KV) behind
`minillm router`, on a tiny random checkpoint (CPU), answer exactly what the colocated engine
answers: completions and chat, streamed and not, several prompts with a shared prefix, usage and
errors passed through; the consumer loaded every prompt's K/V (its log says so) instead of
computing them.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_utils import router, serve

from minillm import LLM, SamplingParams

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SYSTEM = "the cat sat on the mat and looked at the dog, who sat on the rug by the door; "
PROMPTS = [SYSTEM + "then", SYSTEM + "a b c", "hello there", SYSTEM + "the end"]


@pytest.fixture(scope="module", params=["SharedStorageConnector",
                                        pytest.param("SharedPoolConnector", marks=pytest.mark.slow)])
def disagg(tiny_chat_model, tmp_path_factory, request):
    logs, kv = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("kv")
    flags = ["--kv-connector", request.param, "--kv-path", str(kv), "--kv-load-timeout", "20"]
    with serve(tiny_chat_model, "--kv-role", "producer", *flags, log_dir=logs) as p, \
            serve(tiny_chat_model, "--kv-role", "consumer", *flags, log_dir=logs) as c, \
            router(p.base, c.base, logs) as r:
        yield r.base, p, c


@pytest.fixture(scope="module")
def oracle(tiny_chat_model):
    return LLM(str(tiny_chat_model), device="cpu")


@pytest.mark.slow
def test_completions_equal_colocated(disagg, oracle, tiny_chat_model):
    base, producer, consumer = disagg
    expected = oracle.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    body = {"model": str(tiny_chat_model), "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])] == [e.outputs[0].text for e in expected]
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert data["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8 * len(PROMPTS),
                             "total_tokens": prompt_tokens + 8 * len(PROMPTS)}
    # the consumer loaded the K/V it was handed (and the producer saved them)
    assert "KV loaded: " in consumer.output()
    m = consumer.metrics()
    assert m["minillm_kv_transfers_loaded_total"] >= len(PROMPTS) and m["minillm_kv_bytes_loaded_total"] > 0
    if "SharedStorageConnector" in producer.proc.args:  # (the pull transport saves nothing: the consumer copies)
        assert "KV saved: " in producer.output()


def test_streamed_and_chat_equal_colocated(disagg, oracle, tiny_chat_model):
    base, _, _ = disagg
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = oracle.generate(PROMPTS[0], params)[0]
    body = {"model": str(tiny_chat_model), "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    assert text == expected.outputs[0].text
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids) and usage["completion_tokens"] == 6
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    chat = oracle.chat(messages, SamplingParams(max_tokens=7, temperature=0.0))[0]
    reply = httpx.post(base + "/v1/chat/completions", json={"model": str(tiny_chat_model), "messages": messages,
                                                             "max_tokens": 7, "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == chat.outputs[0].text


def test_errors_pass_through(disagg, tiny_chat_model):
    base, producer, _ = disagg
    bad = {"model": str(tiny_chat_model), "prompt": "hi", "max_tokens": 4, "temperature": -1}
    direct = httpx.post(producer.v1 + "/completions", json=bad, timeout=60)
    routed = httpx.post(base + "/v1/completions", json=bad, timeout=60)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json() and "temperature" in routed.text
    # a handle sent straight to an engine whose role cannot serve it: a 400 naming the role
    wrong = httpx.post(producer.v1 + "/completions", timeout=60, json={
        "model": str(tiny_chat_model), "prompt": "hi", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x"}})
    assert wrong.status_code == 400 and "kv_role is 'producer'" in wrong.text


@pytest.mark.slow
def test_consumer_dying_mid_answer(tiny_chat_model, tmp_path):
    """Kill the consumer while it streams: the client gets an SSE error naming the decode server (not
    a cut stream), and the producer keeps serving, with no KV block left held."""
    logs, kv = tmp_path / "logs", tmp_path / "kv"
    logs.mkdir()
    flags = ["--kv-connector", "SharedPoolConnector", "--kv-path", str(kv), "--kv-send-timeout", "3"]
    with serve(tiny_chat_model, "--kv-role", "producer", *flags, log_dir=logs) as p, \
            serve(tiny_chat_model, "--kv-role", "consumer", *flags, log_dir=logs) as c, \
            router(p.base, c.base, logs) as r:
        body = {"model": str(tiny_chat_model), "prompt": SYSTEM + "and so", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", r.base + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        c.proc.kill()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "the decode server" in error["message"] and c.base in error["message"]
        assert len(events) < 400  # the stream was cut, and said so
        again = httpx.post(p.v1 + "/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        p.wait_idle(timeout=30)  # every block freed: the request's, and the transfer's after the timeout
