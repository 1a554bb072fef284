"""The `minillm` command: the main job works, and bad input is a clear one-line error (exit 2)."""

from __future__ import annotations

from minillm.cli import main


def test_tokenize_chat(capsys, tok):
    assert main(["tokenize", "--chat", "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert f"ids: {tok.encode(prompt)}" in out
    assert "<|im_start|>assistant" in out


def test_tokenize_reports_dropped_bytes(capsys):
    assert main(["tokenize", "--ids-only", "a\x04b"]) == 0
    assert "have no token and were dropped" in capsys.readouterr().out


def test_bad_model_path_is_a_clear_error(capsys, tmp_path):
    assert main(["tokenize", "--model", str(tmp_path / "missing.gguf"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillm: error: no model or tokenizer at") and "Traceback" not in err


def test_unknown_benchmark(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'; available: ceilings, tokenizer" in capsys.readouterr().err


def test_labs_build(tmp_path, capsys):
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "notebooks" / "labs"
    assert main(["labs", "build", "--src", str(src), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == sorted(p.name for p in src.glob("[0-9]*.ipynb"))


def test_generate_answers(capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "16", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "tok/s" in captured.err


def test_generate_rejects_bad_sampling(capsys):
    assert main(["generate", "hi", "--temperature", "-1", "--device", "cpu"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_chat_reads_turns_until_eof(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["chat", "--max-tokens", "12", "--device", "cpu"]) == 0
    assert "Paris" in capsys.readouterr().out
