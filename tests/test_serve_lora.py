"""`minillm serve --enable-lora --lora-modules NAME=PATH ...` (chapter 16): the OpenAI `model` field
picks an adapter, /v1/models lists them, and a served answer equals LLM.generate / LLM.chat with the
same adapter in this process (whose tokens test_lora.py proves equal to PEFT's); an unknown model is a
404 naming what is served; a bad adapter folder stops the server at start with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from lora_utils import make_adapter
from serve_utils import free_port, serve

from minillm import LLM, SamplingParams
from minillm.lora.request import LoRARequest

pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow  # a server process per module, and two more that fail to start

ADAPTERS = {"upper": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
            "french": dict(r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj"])}


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        make_adapter(tiny_chat_model, root / name, seed + 5, **fields)
    return {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def server(tiny_chat_model, adapters, tmp_path_factory):
    modules = [f"{n}={r.lora_path}" for n, r in adapters.items()]
    with serve(tiny_chat_model, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
               "--max-lora-rank", "8", "--lora-modules", *modules, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(tiny_chat_model):
    return LLM(str(tiny_chat_model), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)


def test_models_lists_the_adapters(server, adapters):
    cards = httpx.get(f"{server.v1}/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == ["base", "upper", "french"]
    assert cards[1]["parent"] == "base" and cards[1]["root"] == adapters["upper"].lora_path
    assert httpx.get(f"{server.v1}/models/french", timeout=30).json()["id"] == "french"


def test_model_field_selects_the_adapter(server, adapters, oracle):
    prompt = [5, 17, 99, 3, 250, 41, 7, 12, 64]
    texts = {}
    for model in ("base", "upper", "french"):
        r = httpx.post(f"{server.v1}/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        want = oracle.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False, lora_request=adapters.get(model))[0].outputs[0].text
        texts[model] = r.json()["choices"][0]["text"]
        assert r.json()["model"] == model  # the answer names the adapter that made it
        assert texts[model] == want, model
    assert len(set(texts.values())) == 3  # each adapter answers differently
    assert server.metrics()["minillm_lora_slot_loads_total"] >= 2  # both adapters went into a GPU slot
    messages = [{"role": "user", "content": "hello there"}]
    r = httpx.post(f"{server.v1}/chat/completions", json={"model": "french", "messages": messages, "max_tokens": 6,
                                                          "temperature": 0}, timeout=60)
    want = oracle.chat(messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
                       lora_request=adapters["french"])[0].outputs[0].text
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    with httpx.stream("POST", f"{server.v1}/chat/completions", timeout=60, json={
            "model": "french", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want
    assert {c["model"] for c in chunks} == {"french"}


def test_unknown_model_is_404_naming_the_served(server):
    r = httpx.post(f"{server.v1}/completions", json={"model": "german", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 404
    assert "`base`, `upper`, `french`" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model"


def test_bad_adapter_stops_the_start(tiny_chat_model, tmp_path):
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", str(tiny_chat_model), "--device", "cpu",
           "--port", str(free_port()), "--enable-lora", "--lora-modules", f"x={tmp_path / 'missing'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2 and "LoRA adapter 'x': lora_path" in out.stderr and "is not a folder" in out.stderr
    out = subprocess.run([*cmd[:-3], "--lora-modules", "x=/a"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 2 and "--lora-modules and --lora-root need --enable-lora" in out.stderr


def test_runtime_load_and_unload_inside_the_root(tiny_chat_model, adapters, oracle, tmp_path_factory):
    import json
    import os

    root = os.path.dirname(adapters["upper"].lora_path)
    outside = tmp_path_factory.mktemp("outside")
    os.symlink(outside, os.path.join(root, "escape"))
    bad = os.path.join(root, "rank32")
    os.makedirs(bad, exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        src = os.path.join(adapters["upper"].lora_path, f)
        data = open(src, "rb").read()
        if f.endswith(".json"):
            data = json.dumps({**json.loads(data), "r": 32}).encode()
        open(os.path.join(bad, f), "wb").write(data)
    prompt = [5, 17, 99, 3, 250, 41, 7, 12, 64]
    with serve(tiny_chat_model, "--served-model-name", "base", "--enable-lora", "--max-lora-rank", "8",
               "--lora-root", root, log_dir=tmp_path_factory.mktemp("logs")) as s:
        def post(path, body):
            return httpx.post(f"{s.v1}/{path}", json=body, timeout=60)

        for path, code, match in (("../x", 400, "outside the folder"), ("escape", 400, "outside the folder"),
                                  ("rank32", 400, "rank r=32 is above max_lora_rank=8"), ("missing", 400, "not a folder")):
            r = post("load_lora_adapter", {"lora_name": "u", "lora_path": path})
            assert r.status_code == code and match in r.json()["error"]["message"], (path, r.text)
        assert post("load_lora_adapter", {"lora_name": "u", "lora_path": "upper"}).status_code == 200
        assert post("load_lora_adapter", {"lora_name": "u", "lora_path": "upper"}).status_code == 400  # taken
        assert [c["id"] for c in httpx.get(f"{s.v1}/models", timeout=30).json()["data"]] == ["base", "u"]
        r = post("completions", {"model": "u", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        want = oracle.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False, lora_request=adapters["upper"])[0].outputs[0].text
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert post("unload_lora_adapter", {"lora_name": "u"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "u"}).status_code == 404
        assert post("completions", {"model": "u", "prompt": prompt, "max_tokens": 2}).status_code == 404


def test_runtime_updates_are_off_without_a_root(server):
    r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "u", "lora_path": "/"}, timeout=30)
    assert r.status_code == 404
