"""Chapter 02's loaders: GGUF dequantization against the gguf package, llama.cpp's q/k row order,
configs, dummy weights, and clear errors for what cannot be loaded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minillm.config import ModelConfig, preset
from minillm.gguf_meta import open_gguf
from minillm.loader import load_model
from minillm.loader.dequant import dequantize
from minillm.loader.gguf_loader import unpermute


def test_dequant_matches_gguf_on_the_embedded_model(gguf_path):
    from gguf.quants import dequantize as reference

    seen = set()
    for t in open_gguf(gguf_path).tensors:
        kind = t.tensor_type.name
        if kind in ("Q4_1", "Q8_0") and (kind not in seen or t.name.startswith("blk.7.")):
            shape = tuple(int(s) for s in reversed(t.shape))
            ours = dequantize(torch.from_numpy(np.array(t.data)), kind, shape)
            theirs = torch.from_numpy(reference(np.array(t.data), t.tensor_type)).reshape(shape)
            assert torch.equal(ours, theirs.float()), t.name
            seen.add(kind)
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_dequant_matches_gguf_on_random_blocks(kind, seed):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((24, 96)) * rng.uniform(0.01, 10)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(x, qtype)  # [24, bytes per row]
    ours = dequantize(torch.from_numpy(raw), kind, (24, 96))
    assert torch.equal(ours, torch.from_numpy(reference(raw, qtype)).float())
    assert (ours - torch.from_numpy(x)).abs().max() < np.abs(x).max() * (0.1 if kind == "Q4_1" else 0.01)


def test_unpermute_inverts_llama_cpp_permute(seed):
    def permute(w, n_head):  # how llama.cpp's converter reorders q/k rows (convert_hf_to_gguf.py)
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    torch.manual_seed(seed)
    for heads, dim in [(9, 64), (3, 64), (32, 128)]:
        w = torch.randn(heads * dim, 16)
        assert torch.equal(unpermute(permute(w, heads), heads), w)
        assert not torch.equal(permute(w, heads), w)


def test_config_readers_reject_what_is_unsupported():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_hf(base).head_dim == 4
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf(base | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope scaling 'yarn' is supported for latent-attention"):
        ModelConfig.from_hf(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf(base | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-5")


def test_dummy_weights_for_any_config():
    config = ModelConfig(architecture="qwen3", vocab_size=500, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=128, qk_norm=True)
    model, cfg, tok = load_model(config, load_format="dummy")
    assert tok is None and cfg is config
    n = sum(p.numel() for p in model.parameters())
    assert n == config.num_params
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert preset("qwen3-0.6b").num_params == pytest.approx(0.6e9, rel=0.05)
    assert preset("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert preset("smollm2-135m").num_params == 134_515_008


def test_incomplete_or_misshapen_checkpoints(tmp_path):
    from tiny_models import make_tiny

    folder = make_tiny("llama2-tied", tmp_path / "m")
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_model(folder)
    save_file(tensors | {name: tensors[name][:, :-1].contiguous()}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="has shape"):
        load_model(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(folder)


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not download 'nobody/no-such-model'"):
        load_model("nobody/no-such-model")
