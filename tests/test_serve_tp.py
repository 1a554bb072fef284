"""`minillm serve --tensor-parallel-size 2` (chapter 11 through chapter 12's server): the engine core
process is rank 0 and starts one worker process; a greedy completion equals `LLM.generate` at size 1,
and stopping the server stops every process it started (no orphaned rank holding memory)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from serve_utils import children, make_tiny_chat_model, serve

from minillm import LLM, SamplingParams


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


@pytest.mark.slow
def test_serve_at_tp2_answers_as_llm_and_stops_its_workers(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny")
    prompt = "Once upon a time"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model, device="cpu", dtype="float32") as llm:
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    with serve(model, "--tensor-parallel-size", "2", "--dtype", "float32", log_dir=tmp_path) as server:
        name = httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{server.base}/v1/completions", timeout=60, json=dict(
            model=name, prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        procs = _descendants(server.proc.pid)
        assert len(procs) >= 2, "an engine core process and a rank-1 worker"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in procs):
        time.sleep(0.2)
    left = [p for p in procs if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    assert not left, f"processes left after the server stopped: {left}"
