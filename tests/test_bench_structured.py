"""`minillm bench structured` (chapter 14) in its quick mode on a CPU: a tiny random model over the real
SmolLM2 vocabulary (the grammars meet BPE tokens), every field of the JSON there, the masks equal to
xgrammar's on every step walked, the constrained/free ratios the rows' own numbers divided, and every
output that finished valid."""

from __future__ import annotations

import json

import pytest
import torch

from minillm.bench import structured
from minillm.config import ModelConfig

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quick_run_writes_every_field(tok, tmp_path, seed):
    cfg = ModelConfig(architecture="llama", vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, name="tiny-llama", eos_token_ids=[tok.eos_token_id])
    path = tmp_path / "s.json"
    res = structured.run(cfg, tokenizer=tok, quick=True, repeats=3, walk_steps=12, batch_sizes=[1, 4], max_tokens=6,
                         validity_max_tokens=16, num_random_schemas=2, device="cpu", seed=seed, json_path=path,
                         block_size=8, num_gpu_blocks=256)
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))  # JSON-ready as returned
    assert {"header", "ceilings", "versions", "device", "commit", "date", "grammars", "decode", "validity",
            "summary"} <= res.keys()
    assert {"torch", "xgrammar", "jsonschema", "python"} <= res["versions"].keys() and res["versions"]["xgrammar"]
    assert res["device"].startswith("CPU") and res["quick"] and res["repeats"] == 3

    kinds = {g["kind"] for g in res["grammars"]}
    assert kinds == {"regex", "json", "grammar"}
    for g in res["grammars"]:
        assert g["masks_equal"] is True and g["walk_steps"] == 3 * 12, g["grammar"]
        for k in ("ours_cold_ms", "ours_cached_ms", "xgr_cold_ms", "xgr_cached_ms", "ours_p50_us", "ours_p99_us",
                  "xgr_p50_us", "xgr_p99_us"):
            lo, hi = g["spread"][k]
            assert 0 < lo <= g[k] <= hi, (g["grammar"], k)
        assert g["ours_cached_ms"] < g["ours_cold_ms"]  # a hit does not walk the vocabulary again

    s = res["summary"]
    assert s["all_masks_equal"] is True
    for r in range(3):  # per repeat, the median over the 3 grammars of ours / xgrammar: the middle one
        want = sorted(g["per_repeat"]["ours_p50_us"][r] / g["per_repeat"]["xgr_p50_us"][r] for g in res["grammars"])[1]
        assert s["mask_p50_ratio"]["values"][r] == pytest.approx(want)
    for b in (1, 4):
        rows = {(r["mode"], r["repeat"]): r for r in res["decode"] if r["batch"] == b}
        assert len(rows) == 2 * 3 and {r["constrained"] for r in rows.values()} == {0, 1 if b == 1 else 2}
        ratios = [rows["constrained", i]["full_batch_tok_s"] / rows["free", i]["full_batch_tok_s"] for i in range(3)]
        assert s[f"constrained_vs_free_batch{b}"]["values"] == pytest.approx(ratios)
        assert all(r["full_batch_tok_s"] > 0 and r["step_ms"] > 0 for r in rows.values())
        # a free step pays one test per sequence; a constrained one fills masks and walks tokens
        assert max(r["grammar_ms"] for (m, _), r in rows.items() if m == "free") < \
            min(r["grammar_ms"] for (m, _), r in rows.items() if m == "constrained")
    assert [r["batch"] for r in res["apply"]] == [1, 4]
    assert all(r["torch_ms"] > 0 and r["triton_ms"] is None for r in res["apply"])  # no Triton timing on a CPU

    v = res["validity"]
    assert v["cases"] == 3 + 2 and v["outputs"] == 2 * v["cases"]
    assert v["valid_pct_of_finished"] == 100.0, v["invalid"]
    assert 0 < v["finished_pct"] <= 100 and 0 <= v["jump_forward_steps_pct"] <= 100
