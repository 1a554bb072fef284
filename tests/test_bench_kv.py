"""`minillm bench kv` (chapter 15) on a tiny random model over SmolLM2's real vocabulary, on a CPU: every
policy's row is there, the memory the engine reports is what each policy must hold, the full cache agrees
with itself, the ratios are the rows' own numbers divided, and the JSON is what run() returns."""

from __future__ import annotations

import json

import pytest
import torch

from minillm.bench import WORKLOADS, kv
from minillm.config import ModelConfig


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_cfg(tok):
    return ModelConfig(architecture="llama", vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                       tie_word_embeddings=True, name="tiny-llama", eos_token_ids=[tok.eos_token_id])


def test_registered_and_bad_options_refused(tok):
    assert WORKLOADS["kv"][0] == "minillm.bench.kv"
    with pytest.raises(ValueError, match="policies must include 'full'"):
        kv.run(tiny_cfg(tok), tokenizer=tok, policies=["h2o"], device="cpu")
    with pytest.raises(ValueError, match="repeats"):
        kv.run(tiny_cfg(tok), tokenizer=tok, repeats=0, device="cpu")
    with pytest.raises(ValueError, match="parts must name"):
        kv.run(tiny_cfg(tok), tokenizer=tok, parts=["memory"], device="cpu")


def test_passkey_prompt_hides_the_key(tok):
    for depth in (0.0, 0.5, 1.0):
        ids = kv.passkey_prompt(tok, 200, depth, 48151)
        text = tok.decode(ids)
        assert 150 <= len(ids) <= 200 and text.count("48151") == 2 and text.endswith("The pass key is")
    early, late = (tok.decode(kv.passkey_prompt(tok, 200, d, 48151)).index("48151") for d in (0.0, 1.0))
    assert early < late


@pytest.mark.slow
def test_quick_run_writes_every_field(tok, tmp_path):
    path = tmp_path / "kv.json"
    res = kv.run(tiny_cfg(tok), tokenizer=tok, quick=True, repeats=3, budgets=[32], prompt_len=96, max_tokens=8,
                 batch_sizes=[1, 2], passkey_trials=1, device="cpu", json_path=path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert {"header", "versions", "device", "commit", "date", "quality", "speed", "summary", "kept_maps"} <= res.keys()
    q = {r["policy"]: r for r in res["quality"]}
    assert set(q) == set(kv.POLICIES) and not any("skipped" in r for r in q.values())
    full = q["full"]
    assert full["agree_frac"] == 1 and full["first_divergence"] == 8 and full["held_blocks"] == -(-(96 + 8) // 16)
    for name, r in q.items():
        assert len(r["tokens"]) == 8 and 0 <= r["agree_frac"] <= 1 and r["nll_own"] > 0
        assert r["kv_mib"] == pytest.approx(r["held_blocks"] * 16 * res["kv_bytes_per_token"] / 2**20)
        if name != "full":  # 32 tokens = 2 blocks; streaming/h2o hold them (+ the step's own); snapkv: + the new tokens
            assert r["held_blocks"] <= 3 and r["held_blocks"] < full["held_blocks"], name
        maps = res["kept_maps"][f"{name}@{r['budget']}"]
        assert maps and sum(maps[-1]) == r["held_blocks"]
    assert q["streaming-cache"]["reserved_blocks"] == 2  # one sink block x max_num_seqs (the largest batch)
    speed = {(s["policy"], s["batch"]): s for s in res["speed"]}
    assert len(speed) == len(kv.POLICIES) * 2
    for (name, b), s in speed.items():
        vals = s["spread"]["values"]
        assert len(vals) == 3 and s["decode_tok_s"] == pytest.approx(sorted(vals)[1]) and min(vals) > 0
        ratio = res["summary"][f"{name}@{s['budget']}/full batch{b}"]["values"]
        base = speed["full", b]["spread"]["values"]
        assert ratio == pytest.approx([v / f for v, f in zip(vals, base)])


@pytest.mark.slow
def test_parts_run_alone(tok):
    res = kv.run(tiny_cfg(tok), tokenizer=tok, parts=["quality"], repeats=1, budgets=[32], prompt_len=48, max_tokens=4,
                 batch_sizes=[1], passkey_trials=0, device="cpu")
    assert "quality" in res and "speed" not in res and len(res["quality"]) == len(kv.POLICIES)
    res = kv.run(tiny_cfg(tok), tokenizer=tok, parts=["speed"], repeats=1, budgets=[32], prompt_len=48, max_tokens=4,
                 batch_sizes=[1], passkey_trials=0, device="cpu", policies=["full", "h2o"])
    assert "quality" not in res and {s["policy"] for s in res["speed"]} == {"full", "h2o"}
