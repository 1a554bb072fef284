"""The linear layers (vLLM's names) against F.linear, their shard loaders, and the generic weight loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minillm.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minillm.layers.quantization import QuantizationConfig, UnquantizedLinearMethod
from minillm.models.utils import expected_keys, load_weights


@pytest.fixture
def g():
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_layers_are_f_linear(cls, bias, g):
    layer = cls(12, 7, bias=bias)
    w, b = torch.randn(7, 12, generator=g), torch.randn(7, generator=g)
    layer.weight.weight_loader(layer.weight, w)
    if bias:
        layer.bias.weight_loader(layer.bias, b)
    x = torch.randn(5, 12, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b if bias else None))


def test_merged_column_stacks_its_shards(g):
    layer = MergedColumnParallelLinear(8, [6, 6])
    gate, up = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    layer.weight_loader(layer.weight, up, 1)  # shards may come in any order
    layer.weight_loader(layer.weight, gate, 0)
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    with pytest.raises(ValueError, match="has shards"):
        layer.weight_loader(layer.weight, gate, 2)


def test_qkv_stacks_heads_and_knows_its_shapes(g):
    layer = QKVParallelLinear(16, head_size=4, total_num_heads=6, total_num_kv_heads=2, bias=True)
    assert (layer.num_heads, layer.num_kv_heads) == (6, 2) and layer.weight.shape == (24 + 8 + 8, 16)
    parts = {s: torch.randn(n, 16, generator=g) for s, n in (("q", 24), ("k", 8), ("v", 8))}
    biases = {s: torch.randn(t.shape[0], generator=g) for s, t in parts.items()}
    for s in "vqk":
        layer.weight_loader(layer.weight, parts[s], s)
        layer.weight_loader(layer.bias, biases[s], s)
    x = torch.randn(2, 16, generator=g)
    want = torch.cat([F.linear(x, parts[s], biases[s]) for s in "qkv"], dim=-1)
    torch.testing.assert_close(layer(x), want)
    with pytest.raises(ValueError, match=r"has shape \(8, 16\), expected \(24, 16\)"):
        layer.weight_loader(layer.weight, parts["k"], "q")


def test_embedding_and_tied_head(g):
    embed, head = VocabParallelEmbedding(11, 4), ParallelLMHead(11, 4)
    table = torch.randn(11, 4, generator=g)
    embed.weight_loader(embed.weight, table)
    head.tie_weights(embed)
    ids = torch.randint(0, 11, (6,), generator=g)
    torch.testing.assert_close(embed(ids), table[ids])
    h = torch.randn(3, 4, generator=g)
    torch.testing.assert_close(head.compute_logits(h), h @ table.T)
    assert head.weight is embed.weight


class _Tiny(nn.Module):
    stacked = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv_proj = QKVParallelLinear(8, 4, 2, 1)
        self.attn.o_proj = RowParallelLinear(8, 8)


def _checkpoint(g):
    return [("attn.q_proj.weight", torch.randn(8, 8, generator=g)), ("attn.k_proj.weight", torch.randn(4, 8, generator=g)),
            ("attn.v_proj.weight", torch.randn(4, 8, generator=g)), ("attn.o_proj.weight", torch.randn(8, 8, generator=g))]


def test_load_weights_fills_every_parameter_exactly_once(g):
    model, ckpt = _Tiny(), _checkpoint(g)
    assert expected_keys(model) == {"attn.qkv_proj.weight:q", "attn.qkv_proj.weight:k", "attn.qkv_proj.weight:v",
                                    "attn.o_proj.weight"}
    assert load_weights(model, ckpt, _Tiny.stacked) == expected_keys(model)
    torch.testing.assert_close(model.attn.qkv_proj.weight[8:12], ckpt[1][1])
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\), e.g. \['attn.qkv_proj.weight:v'\]"):
        load_weights(_Tiny(), [c for c in ckpt if "v_proj" not in c[0]], _Tiny.stacked)
    with pytest.raises(ValueError, match="'attn.k_proj.weight' is given twice"):
        load_weights(_Tiny(), [*ckpt, ckpt[1]], _Tiny.stacked)
    with pytest.raises(ValueError, match="'attn.x_proj.weight' has no place in _Tiny"):
        load_weights(_Tiny(), [*ckpt, ("attn.x_proj.weight", ckpt[0][1])], _Tiny.stacked)


def test_a_quant_config_chooses_each_layers_method(g):
    """The seam chapter 08 plugs into: a config hands each layer (by prefix) its own method."""
    class Scaled(UnquantizedLinearMethod):
        def apply(self, layer, x, bias=None):
            return 2 * super().apply(layer, x, bias)

    class Config(QuantizationConfig):
        def get_quant_method(self, layer, prefix):
            return Scaled() if prefix.endswith("down_proj") else None

    down = RowParallelLinear(4, 3, quant_config=Config(), prefix="mlp.down_proj")
    up = ColumnParallelLinear(4, 3, quant_config=Config(), prefix="mlp.up_proj")
    w = torch.randn(3, 4, generator=g)
    for layer in (down, up):
        layer.weight_loader(layer.weight, w)
    x = torch.randn(2, 4, generator=g)
    torch.testing.assert_close(down(x), 2 * (x @ w.T))
    torch.testing.assert_close(up(x), x @ w.T)
