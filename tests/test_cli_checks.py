"""Every `minillm` command checks its arguments before it loads anything (issue 30): a mistyped
`eval perplexity --corpus` path is an error, not a download into it; a folder is an error that leaves
no `.part` file in it; ranges are checked as the flags are parsed; bad sampling flags fail before the
model loads."""

from __future__ import annotations

import pytest

import minillm.llm
from minillm.cli import build_parser, main


@pytest.fixture
def no_model(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(minillm.llm, "load_model", load)


def test_eval_corpus_must_be_an_existing_file(tmp_path, capsys, no_model, monkeypatch):
    import minillm.data.corpus as corpus

    monkeypatch.setattr(corpus, "build_cache", lambda *a, **k: pytest.fail("tried to fetch the corpus"))
    missing = tmp_path / "corpsu.txt"
    assert main(["eval", "perplexity", "--device", "cpu", "--corpus", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err and not missing.exists()
    assert main(["eval", "perplexity", "--device", "cpu", "--corpus", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,flag", [
    (["eval", "perplexity", "--max-tokens", "0"], "--max-tokens"),
    (["eval", "perplexity", "--context-len", "-4"], "--context-len"),
    (["eval", "perplexity", "--stride", "x"], "--stride"),
    (["quantize", "--method", "int4", "--out", "o", "--group-size", "48"], "--group-size"),
    (["quantize", "--method", "awq", "--out", "o", "--num-sequences", "0"], "--num-sequences"),
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens"),
])
def test_ranges_are_checked_as_parsed(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_bad_sampling_flags_fail_before_the_model_loads(capsys, no_model):
    assert main(["generate", "hi", "--device", "cpu", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
