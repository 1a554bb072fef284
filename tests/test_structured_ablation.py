"""scripts/gpu/structured_ablation.py (chapter 14) checks itself on a CPU: a tiny random model over the real
SmolLM2 vocabulary, batch 1 and 4 (half constrained), the six modes (free / real grammar / stub grammar,
each with overlap on and off), every per-step figure the rows' own medians subtracted, the host phases
timed, the profile written. Its step times mean nothing off a GPU: the test checks the accounting."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch

from minillm.config import ModelConfig

pytest.importorskip("jsonschema")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu" / "structured_ablation.py"


def _script():
    spec = importlib.util.spec_from_file_location("structured_ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_ablation_runs_every_mode_and_adds_up(tok, tmp_path):
    torch.set_num_threads(1)
    cfg = ModelConfig(architecture="llama", vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, name="tiny-llama", eos_token_ids=[tok.eos_token_id])
    ab = _script()
    res = ab.run(cfg, tokenizer=tok, device="cpu", batch_sizes=[1, 4], max_tokens=6, repeats=2,
                 json_path=tmp_path / "a.json", profile_dir=str(tmp_path), block_size=8, num_gpu_blocks=256)
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(json.dumps(res))
    for b, constrained in ((1, 1), (4, 2)):
        rows = [r for r in res["rows"] if r["batch"] == b]
        assert sorted(r["mode"] for r in rows) == sorted(ab.MODES * 2)
        for r in rows:
            assert r["constrained"] == (0 if r["mode"].startswith("free") else constrained)
            assert r["tok_s"] > 0 and set(r["phase_ms"]) == {k for _, _, k in ab.PhaseClock.PHASES}
            # only a step with a grammar under overlap defers its sampling
            assert (r["phase_ms"]["sample"] > 0) is (r["mode"] in ("real-overlap", "stub-overlap")), r
        s = res["summary"][f"batch{b}"]

        def med(mode, rows=rows):
            return statistics.median(r["step_ms"] for r in rows if r["mode"] == mode)
        assert s["per_step_ms"]["overlap_lost"] == pytest.approx(med("real-sync") - med("real-overlap"))
        assert s["per_step_ms"]["grammar"] == pytest.approx(med("real-overlap") - med("stub-overlap"))
        assert s["per_step_ms"]["mask_path"] == pytest.approx(med("stub-overlap") - med("free-overlap"))
        assert s["real_overlap_vs_free_overlap"]["min"] <= s["real_overlap_vs_free_overlap"]["median"]
    assert [p["mode"] for p in res["profiles"]] == ["free-overlap", "real-overlap", "stub-overlap"]
    assert all((tmp_path / f"structured-profile-{m}.txt").exists() for m in ("free-overlap", "real-overlap"))
