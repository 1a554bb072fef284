"""`minillm bench lora` (chapter 16) on a tiny random HF model on a CPU: every field of the JSON there,
PEFT's greedy tokens equal ours for every adapter (fp32, one mixed batch against each alone), the
ratios the rows' own medians divided, and the registry and CLI options wired."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny

from minillm.bench import WORKLOADS, _resolve, lora

pytest.importorskip("peft")


@pytest.mark.slow
def test_quick_run_writes_every_field(tmp_path):
    torch.set_num_threads(1)
    base = make_tiny("llama3", tmp_path / "base")
    path = tmp_path / "l.json"
    res = lora.run(str(base), num_adapters=[0, 1, 3], batch_sizes=[1, 3], rank=8, prompt_len=6, max_tokens=4,
                   repeats=3, device="cpu", json_path=path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert {"header", "ceilings", "device", "commit", "date", "check", "rows", "summary"} <= res.keys()
    assert res["summary"]["all_equal"] is True
    assert [r["adapter"] for r in res["check"]] == ["base", "a0", "a1", "a2"]
    outs = [tuple(r["peft"]) for r in res["check"]]
    assert len(set(outs)) > 1  # the random adapters change the answers: the parity can fail
    configs = {(r["batch"], r["config"]) for r in res["rows"]}
    assert configs == {(1, "base"), (1, "lora n=0"), (1, "lora n=1"),
                       (3, "base"), (3, "lora n=0"), (3, "lora n=1"), (3, "lora n=3")}
    for r in res["rows"]:
        base_row = next(b for b in res["rows"] if b["batch"] == r["batch"] and not b["lora"])
        assert r["decode_vs_base"] == pytest.approx(r["decode_tok_s"]["median"] / base_row["decode_tok_s"]["median"])
        for k in ("prefill_tok_s", "decode_tok_s", "output_tok_s", "peft_output_tok_s"):
            s = r[k]
            assert len(s["values"]) == 3 and 0 < s["min"] <= s["median"] <= s["max"], (r["config"], k)
        ratios = [a / b for a, b in zip(r["output_tok_s"]["values"], r["peft_output_tok_s"]["values"])]
        assert r["ours_vs_peft"]["values"] == pytest.approx(ratios)
        assert ("peft_merged_output_tok_s" in r) == (r["distinct_adapters"] == 1)


def test_registered_with_options():
    assert "lora" in WORKLOADS
    module, fn = _resolve("lora")
    assert fn is lora.run
    import argparse

    p = argparse.ArgumentParser()
    module.add_arguments(p, "lora")
    a = p.parse_args(["--num-adapters", "0", "1", "4", "16", "--batch-sizes", "1", "64", "--json", "x.json",
                      "--no-peer"])
    assert a.num_adapters == [0, 1, 4, 16] and a.batch_sizes == [1, 64] and a.json_path == "x.json" and not a.peer


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(max_tokens=1), dict(num_adapters=[-1])])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        lora.run("unused", device="cpu", **bad)
