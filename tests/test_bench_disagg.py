"""`minillm bench disagg` on a CPU with tiny sizes: both setups run the same Poisson schedules, the
disaggregated tokens equal the colocated ones, the SLO is named, and the burst's ITL windows are
measured; the ITL split of a burst on a hand-made timeline."""

from __future__ import annotations

import math

import pytest

from minillm.bench.disagg import burst_itl, poisson_schedule


def test_burst_windows_split_the_gaps():
    # two decodes from t0 = 0; a burst at 1.0 whose last first token lands at 1.5
    schedule = [(0.0, [1], 9), (0.0, [1], 9), (1.0, [1] * 8, 2)]
    got = {0: ([0] * 4, [0.2, 0.4, 0.6, 1.8]), 1: ([0] * 3, [0.3, 0.5, 1.2]), 2: ([0, 0], [1.5, 1.6])}
    out = burst_itl(schedule, got, 0.0, 2)
    assert out["gaps_decode_only"] == 3 and out["gaps_during_burst"] == 2
    assert math.isclose(out["itl_p99_during_burst_ms"], 1195.0, rel_tol=1e-6)  # p99 of 1200 and 700 ms (linear)


def test_schedules_are_seeded():
    sizes = {"prompt": (4, 8), "output": (2, 3)}
    assert poisson_schedule(4.0, 5, sizes, 100, 1) == poisson_schedule(4.0, 5, sizes, 100, 1)
    assert poisson_schedule(4.0, 5, sizes, 100, 1) != poisson_schedule(4.0, 5, sizes, 100, 2)


@pytest.mark.slow
def test_bench_disagg_tokens_equal_colocated(capsys, monkeypatch, tmp_path):
    from minillm.bench import run

    monkeypatch.setenv("MINILLM_BENCH_JSON", str(tmp_path / "disagg.json"))
    report = run("disagg", device="cpu", rates="16,64", num_prompts=4)
    assert [r["rate"] for r in report["rates"]] == [16.0, 64.0]
    for row in report["rates"]:
        assert row["tokens_equal"] == row["requests"] == 4
        for setup in ("colocated", "disagg"):
            assert row[setup]["completed"] == 4 and row[setup]["median_ttft_ms"] > 0
    assert report["slo"]["ttft_ms"] > 0 and "colocated median" in report["slo"]["rule"]
    b = report["burst"]
    assert b["tokens_equal"] == b["decodes"] + b["prompts"]
    assert b["colocated"]["gaps_during_burst"] > 0 and b["disagg"]["gaps_decode_only"] > 0
    assert "not two devices" in capsys.readouterr().out
    assert (tmp_path / "disagg.json").exists()
