"""A corrupt Hugging Face folder is a ValueError that names the file and the field, never a bare
traceback (AttributeError, KeyError, JSONDecodeError), and a shard index cannot make the loader read
files outside the model folder or load a tensor given twice."""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_models import make_tiny

from minillm.loader import load_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny checkpoint in several shards, with model.safetensors.index.json."""
    folder = make_tiny("llama2-tied", tmp_path_factory.mktemp("sharded") / "m", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


@pytest.fixture
def folder(sharded, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(sharded, copy)
    return copy


def _write(folder, name, obj):
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _json(folder, name):
    return json.loads((folder / name).read_text())


def test_the_clean_sharded_folder_loads(folder):
    _, config, _ = load_model(folder)
    assert config.num_layers == 2


@pytest.mark.parametrize("change,match", [
    (lambda cfg: [cfg], r"config\.json must hold a JSON object \(\{\.\.\.\}\), not a JSON list"),
    (lambda cfg: "{not json", r"config\.json is not valid JSON"),
    (lambda cfg: {k: v for k, v in cfg.items() if k != "num_attention_heads"},
     r"config\.json: the field 'num_attention_heads' is missing"),
    (lambda cfg: {k: v for k, v in cfg.items() if k != "hidden_size"}, r"config\.json: the field 'hidden_size' is missing"),
    (lambda cfg: cfg | {"num_hidden_layers": 2.0}, r"config\.json: num_hidden_layers must be an int, not float \(2\.0\)"),
    (lambda cfg: cfg | {"vocab_size": "320"}, r"config\.json: vocab_size must be an int, not str"),
    (lambda cfg: cfg | {"rope_theta": "big"}, r"config\.json: rope_theta must be a number, not str"),
    (lambda cfg: cfg | {"num_key_value_heads": 3}, r"config\.json: .*multiple of num_kv_heads"),
])
def test_corrupt_config_names_the_file_and_the_field(folder, change, match):
    _write(folder, "config.json", change(_json(folder, "config.json")))
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_corrupt_generation_config_names_the_file(folder):
    _write(folder, "generation_config.json", [1, 2])
    with pytest.raises(ValueError, match=r"generation_config\.json must hold a JSON object"):
        load_model(folder)


@pytest.mark.parametrize("change,match", [
    (lambda idx: {"metadata": idx["metadata"]}, r"model\.safetensors\.index\.json has no 'weight_map'"),
    (lambda idx: "{not json", r"model\.safetensors\.index\.json is not valid JSON"),
    (lambda idx: [idx], r"model\.safetensors\.index\.json must hold a JSON object"),
    (lambda idx: idx | {"weight_map": ["a"]}, r"'weight_map' must be a non-empty object"),
    (lambda idx: idx | {"weight_map": idx["weight_map"] | {"x": 7}}, r"weight_map\['x'\] must be a shard file name"),
])
def test_corrupt_shard_index_names_the_file(folder, change, match):
    _write(folder, "model.safetensors.index.json", change(_json(folder, "model.safetensors.index.json")))
    with pytest.raises(ValueError, match=match):
        load_model(folder)


@pytest.mark.parametrize("shard", ["../x.safetensors", "../model/model-00001-of-00015.safetensors",
                                   "/etc/passwd", "sub/../../x.safetensors", "..\\x.safetensors", "C:\\x.safetensors"])
def test_shard_index_cannot_point_outside_the_folder(folder, shard):
    """Before, "../x" read a file next to the folder (or reported it missing) and "/etc/passwd" was opened."""
    outside = folder.parent / "x.safetensors"
    shutil.copy(next(folder.glob("model-*.safetensors")), outside)  # a readable file is waiting out there
    idx = _json(folder, "model.safetensors.index.json")
    name = next(iter(idx["weight_map"]))
    _write(folder, "model.safetensors.index.json", idx | {"weight_map": idx["weight_map"] | {name: shard}})
    with pytest.raises(ValueError, match=r"outside the model folder"):
        load_model(folder)


def test_a_shard_in_a_subfolder_is_fine(folder):
    idx = _json(folder, "model.safetensors.index.json")
    first = next(folder.glob("model-*.safetensors"))
    (folder / "sub").mkdir()
    first.rename(folder / "sub" / first.name)
    wm = {k: (f"sub/{v}" if v == first.name else v) for k, v in idx["weight_map"].items()}
    _write(folder, "model.safetensors.index.json", idx | {"weight_map": wm})
    load_model(folder)


@pytest.mark.parametrize("indexed", [True, False])
def test_a_tensor_in_two_shards_is_an_error(folder, indexed):
    from safetensors.torch import load_file, save_file

    shards = sorted(folder.glob("model-*.safetensors"))
    a, b = load_file(shards[0]), load_file(shards[1])
    name = next(iter(a))
    save_file(b | {name: a[name] + 1}, shards[1])  # a second, different copy
    if not indexed:  # the folder's *.safetensors are read without an index
        (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=rf"tensor '{name}' is in two shards, {shards[0].name} and {shards[1].name}"):
        load_model(folder)
