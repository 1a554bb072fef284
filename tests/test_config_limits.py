"""Model configs are checked before anything is allocated (issue 30): against sane limits, against the
checkpoint's tensor shapes (read from the safetensors headers only) and against the device's memory;
dummy presets that LLM cannot serve are refused before they are built. Every error names the file (or
the preset), the field and its value. Each case proves "before any allocation" by making the model
builder fail if it is reached."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from tiny_models import make_tiny

import minillm.loader as loader
from minillm import LLM
from minillm.config import ModelConfig, preset
from minillm.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama2-tied", tmp_path_factory.mktemp("limits") / "m")


@pytest.fixture
def folder(tiny, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny, copy)
    return copy


@pytest.fixture
def no_build(monkeypatch):
    """Building a model is an error: whatever is refused must be refused before it."""
    def build(*args, **kwargs):
        raise AssertionError("the model was built before the config was refused")

    monkeypatch.setattr(loader, "_build", build)


def _edit(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 100_000), ("num_hidden_layers", 10**12),
                                         ("vocab_size", 10**9), ("max_position_embeddings", 10**12),
                                         ("hidden_size", 10**7), ("num_attention_heads", 10**6)])
def test_configs_past_the_limits_are_refused_at_once(folder, no_build, field, value):
    _edit(folder, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"config\.json: {field}={value} is beyond what minillm accepts"):
        load_model(folder)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("changes,match", [
    ({"num_hidden_layers": 3}, r"num_hidden_layers=3, but the checkpoint holds layers 0 to 1 only"),
    ({"vocab_size": 4000}, r"vocab_size=4000 and hidden_size=64 say model\.embed_tokens\.weight is \[4000, 64\], "
                           r"but model\.safetensors holds \[320, 64\]"),
    ({"intermediate_size": 4096}, r"intermediate_size=4096 .*mlp\.gate_proj\.weight is \[4096, 64\]"),
    ({"head_dim": 32}, r"num_attention_heads=4 x head_dim=32 .*q_proj\.weight is \[128, 64\]"),
])
def test_configs_that_disagree_with_the_checkpoint_are_refused(folder, no_build, changes, match):
    _edit(folder, **changes)
    with pytest.raises(ValueError, match=r"config\.json: " + match):
        load_model(folder)


def test_the_limits_hold_for_direct_configs_too():
    base = preset("smollm2-135m").as_dict()
    with pytest.raises(ValueError, match=r"config num_layers=100000 is beyond"):
        ModelConfig(**{**base, "num_layers": 100_000, "sliding_windows": []})
    assert ModelConfig(**base).num_layers == 30  # the real ones pass


def test_a_model_larger_than_the_device_is_refused_before_building(no_build, monkeypatch):
    monkeypatch.setattr(loader, "_device_memory", lambda device: 8 * 2**30)
    with pytest.raises(ValueError, match=r"preset 'qwen3-30b-a3b': the model needs at least 113\.8 GiB for "
                                         r"30,532,122,624 parameters in float32 .* but cpu has 8\.0 GiB"):
        load_model("qwen3-30b-a3b", load_format="dummy")
    # a huge context: RoPE's tables are what does not fit, and the message says so
    config = preset("smollm2-135m").with_(max_position_embeddings=1 << 24, name="long")
    with pytest.raises(ValueError, match=r"long: .* max_position_embeddings=16777216 \(RoPE tables of 8\.0 GiB\)"):
        load_model(config, load_format="dummy")


def test_the_real_memory_bound_lets_small_models_through():
    model, _, _ = load_model(preset("smollm2-135m").with_(num_layers=1, sliding_windows=[None]), load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_llm_refuses_dummy_and_bad_engine_args_before_loading(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr("minillm.llm.load_model", load)
    with pytest.raises(ValueError, match="load_format='dummy' has no tokenizer"):
        LLM("qwen3-30b-a3b", load_format="dummy", device="cpu")
    # a string speculative_config: the TypeError names it (not "unknown LLM argument")
    with pytest.raises(TypeError, match=r"^speculative_config must be a dict or a SpeculativeConfig, not str"):
        LLM(device="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(TypeError, match="unknown LLM argument"):
        LLM(device="cpu", block_sise=16)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        LLM(device="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="need enable_kv_cache=True"):
        LLM(device="cpu", enable_kv_cache=False, max_num_seqs=4)
    assert torch.get_default_dtype() == torch.float32
