"""`minillm quantize` never destroys its input and never leaves half a folder (issue 30): --out equal
to the model's folder, inside it, a file, a non-empty folder (without --overwrite) or a place no folder
can be made is refused before the model loads; the folder is written under a temporary name and
renamed into place, so a failure leaves the old folder (or none); a corrupt saved folder is a
ValueError naming the file; a model with routed experts is refused up front."""

from __future__ import annotations

import hashlib
import json

import pytest
from tiny_models import make_tiny

import minillm.quantize
from minillm.cli import main
from minillm.layers.quantization.calibration import load_quantized
from minillm.loader import load_model
from minillm.quantize import quantize_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama3", tmp_path_factory.mktemp("qs") / "model", intermediate_size=128)


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was refused")

    monkeypatch.setattr(minillm.quantize, "load_model", load)  # the name quantize_model calls


def _quantize(capsys, *args) -> tuple[int, str]:
    code = main(["quantize", "--method", "int8", "--device", "cpu", *args])
    return code, capsys.readouterr().err


def test_out_into_the_model_is_refused_and_the_model_survives(tiny, tmp_path, capsys, no_load):
    before = _digest(tiny)
    for out, match in [(tiny, "inside the model's folder"), (tiny / "q", "inside the model's folder"),
                       (tiny / "config.json", "is a file")]:
        for extra in ([], ["--overwrite"]):
            code, err = _quantize(capsys, "--model", str(tiny), "--out", str(out), *extra)
            assert code == 2 and match in err, err
    # a folder that holds the model: even --overwrite must not replace it
    code, err = _quantize(capsys, "--model", str(tiny), "--out", str(tiny.parent), "--overwrite")
    assert code == 2 and "holds the model" in err
    assert _digest(tiny) == before


def test_out_that_cannot_be_written_is_refused_before_loading(tiny, tmp_path, capsys, no_load):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("x")
    for out, match in [(tmp_path / "busy", "is not empty; choose a new folder, or pass --overwrite"),
                       (tmp_path / "a-file", "is a file"),
                       (tmp_path / "a-file" / "sub", "not a writable folder")]:
        code, err = _quantize(capsys, "--model", str(tiny), "--out", str(out))
        assert code == 2 and match in err, err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"


def test_overwrite_replaces_atomically(tiny, tmp_path, capsys):
    out = tmp_path / "q"
    code, err = _quantize(capsys, "--model", str(tiny), "--out", str(out))
    assert code == 0, err
    before = _digest(out)
    code, err = _quantize(capsys, "--model", str(tiny), "--out", str(out), "--overwrite")
    assert code == 0, err
    assert _digest(out).keys() == before.keys()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "quant_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no temporary folder left beside it
    load_model(tiny, quantization=load_quantized(out))


def test_overwrite_replaces_only_what_quantize_wrote(tiny, tmp_path, capsys, no_load, monkeypatch):
    """Probe round 4, M5: `--out . --overwrite` in a project folder deleted the whole folder."""
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "notes.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)  # `--out .` inside it: test_the_working_directory_and_home_are_never_replaced
    code, err = _quantize(capsys, "--model", str(tiny), "--out", "proj", "--overwrite")
    assert code == 2 and "replaces only a folder written by `minillm quantize`" in err and "src" in err, err
    assert (project / "src" / "notes.txt").read_text() == "precious"
    # a quantize folder the user added a file to, and a folder with a foreign quant_config.json
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "quant_config.json").write_text(json.dumps({"format": "minillm-quantized"}))
    (tmp_path / "q" / "mine.txt").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "quant_config.json").write_text(json.dumps({"quant_method": "awq"}))
    for out, match in [(tmp_path / "q", "it holds mine.txt"), (tmp_path / "other", "has no quant_config.json")]:
        code, err = _quantize(capsys, "--model", str(tiny), "--out", str(out), "--overwrite")
        assert code == 2 and match in err, err
    assert (tmp_path / "q" / "mine.txt").exists() and (tmp_path / "other" / "quant_config.json").exists()
    with pytest.raises(ValueError, match="replaces only a folder written by"):
        quantize_model(tiny, "int8", {}, project, overwrite=True)


def test_a_failed_write_leaves_the_old_folder(tiny, tmp_path, monkeypatch):
    out = quantize_model(tiny, "int8", {}, tmp_path / "q")
    before = _digest(out)

    def save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("minillm.layers.quantization.saved.save_file", save_file)  # the name save_quantized calls
    with pytest.raises(OSError, match="disk full"):
        quantize_model(tiny, "int8", {}, out, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        quantize_model(tiny, "int8", {}, tmp_path / "new")
    assert _digest(out) == before and [p.name for p in tmp_path.iterdir()] == ["q"]


def test_a_corrupt_saved_folder_names_the_file(tiny, tmp_path):
    out = quantize_model(tiny, "int8", {}, tmp_path / "q")
    tensors = out / "model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(tiny, quantization=load_quantized(out))
    tensors.unlink()
    with pytest.raises(ValueError, match=r"has quant_config\.json but no model\.safetensors"):
        load_quantized(out)
    config = json.loads((out / "quant_config.json").read_text())
    del config["model"]
    (out / "quant_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_config\.json: 'model' must describe the model"):
        load_quantized(out)


def test_moe_models_are_refused_up_front(tmp_path, capsys, no_load):
    moe = make_tiny("mixtral", tmp_path / "moe")
    code, err = _quantize(capsys, "--model", str(moe), "--out", str(tmp_path / "q"))
    assert code == 2 and "routed experts" in err and "quantization='int8'" in err
    assert not (tmp_path / "q").exists()


def test_the_working_directory_and_home_are_never_replaced(tiny, tmp_path, capsys, no_load, monkeypatch):
    """Replacing moves --out aside and deletes it: `--out .` in an empty folder, or in one an earlier
    quantize wrote, left the shell in a deleted working directory (probe round 4, M5). The working
    directory, a folder holding it and the home directory are refused, with or without --overwrite."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    quantized = tmp_path / "old-q"
    quantized.mkdir()
    (quantized / "quant_config.json").write_text(json.dumps({"format": "minillm-quantized"}))
    (quantized / "model.safetensors").write_bytes(b"old")
    empty = tmp_path / "empty"
    (empty / "deeper").mkdir(parents=True)
    for cwd, out, extra in [(quantized, ".", ["--overwrite"]), (empty / "deeper", "..", ["--overwrite"]),
                            (empty / "deeper", ".", []), (tmp_path, "~", []), (tmp_path, "~", ["--overwrite"])]:
        monkeypatch.chdir(cwd)
        code, err = _quantize(capsys, "--model", str(tiny), "--out", out, *extra)
        assert code == 2 and ("working directory" in err or "home directory" in err), (cwd, out, err)
        assert cwd.is_dir()
    assert (quantized / "model.safetensors").read_bytes() == b"old"
    assert (empty / "deeper").is_dir() and (tmp_path / "home").is_dir()
