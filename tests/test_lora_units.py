"""Multi-LoRA's parts on their own (chapter 16): where each checkpoint module lands in the fused
layers, the GPU slots' LRU, the CPU pool that never drops an adapter in use, the prefix cache's
adapter key (hash and radix, eviction included), and a LoRA layer's Triton path against its
PyTorch path inside a forward context."""

from __future__ import annotations

import pytest
import torch
from lora_utils import make_adapter
from tiny_models import make_tiny

from minillm.engine.prefix_cache import HashPrefixCache, RadixPrefixCache
from minillm.forward_context import set_forward_context
from minillm.layers.backend import kernel_mode
from minillm.loader import load_model
from minillm.lora.adapter import LoRAModel, lora_targets
from minillm.lora.layers import QKVParallelLinearWithLoRA, set_adapter, wrap_lora_layers
from minillm.lora.manager import LoRAManager
from minillm.lora.request import LoRARequest

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny("llama3", tmp_path_factory.mktemp("lora-units") / "base")


@pytest.fixture(scope="module")
def model(base):
    return load_model(str(base), device="cpu", tokenizer=False)[0]


def test_targets_map_onto_the_fused_slices(model):
    t = lora_targets(model)
    assert set(t) == {f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    q, v, up = t["model.layers.1.self_attn.q_proj"], t["model.layers.1.self_attn.v_proj"], t["model.layers.1.mlp.up_proj"]
    assert (q.module, q.slice, q.in_features, q.out_features) == ("model.layers.1.self_attn.qkv_proj", 0, 64, 64)
    assert (v.module, v.slice, v.out_features) == ("model.layers.1.self_attn.qkv_proj", 2, 32)  # 2 KV heads of 16
    assert (up.module, up.slice, up.out_features) == ("model.layers.1.mlp.gate_up_proj", 1, 112)


def fake(i: int) -> LoRAModel:
    return LoRAModel(i, f"a{i}", 4, 1.0, {})


def test_slots_are_lru_and_never_evict_what_the_step_needs(model):
    mgr = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    for i in (1, 2, 3):
        mgr.requests[i], mgr.cpu[i] = LoRARequest(f"a{i}", i, "/nowhere"), fake(i)
    slots, loads = mgr.prepare([1, 0, 2, 1])
    assert slots == [0, -1, 1, 0] and [s for s, _ in loads] == [0, 1]
    slots, loads = mgr.prepare([2, 3, 0])  # 3 takes 1's slot: the least recently used one not needed
    assert slots == [1, 0, -1] and [(s, m.id) for s, m in loads] == [(0, 3)]
    assert mgr.prepare([2]) == ([1], [])  # resident: nothing to copy
    slots, loads = mgr.prepare([3, 1])  # 2 was used last, but this step needs 3: 1 takes 2's slot
    assert slots == [0, 1] and [(s, m.id) for s, m in loads] == [(1, 1)]
    assert mgr.num_slot_loads == 4
    with pytest.raises(RuntimeError, match="max_loras=2"):
        mgr.prepare([1, 2, 3])


def test_cpu_pool_keeps_adapters_in_use(base, model, tmp_path):
    reqs = [LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")) for i in (1, 2, 3)]
    for seed, r in enumerate(reqs):
        make_adapter(base, r.lora_path, seed, r=4, lora_alpha=4, target_modules=["q_proj"])
    busy = {1}
    mgr = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1, in_use=lambda: busy)
    mgr.check(reqs[0])
    mgr.check(reqs[1])  # 1 is in use: the pool holds two for now
    assert list(mgr.cpu) == [1, 2]
    busy.clear()
    mgr.check(reqs[2])  # nobody uses 1 and 2 any more: back to one
    assert list(mgr.cpu) == [3] and mgr.num_disk_loads == 3
    mgr.check(reqs[2])
    assert mgr.num_disk_loads == 3  # a hit


@pytest.mark.parametrize("cls", [HashPrefixCache, RadixPrefixCache])
def test_prefix_cache_extra_key(cls):
    pc = cls(4)
    tokens = list(range(12))
    pc.insert(tokens, [5, 6], extra_key=7)
    pc.insert(tokens, [8], extra_key=0)
    assert pc.match(tokens, 3, extra_key=7) == [5, 6]
    assert pc.match(tokens, 3, extra_key=0) == [8]
    assert pc.match(tokens, 3, extra_key=3) == []
    for b in (6, 5, 8):
        pc.release(b)
    evicted = [pc.evict() for _ in range(3)]
    assert sorted(evicted) == [5, 6, 8] and pc.evict() is None
    if cls is RadixPrefixCache:
        assert evicted.index(6) < evicted.index(5)  # a leaf before its parent, under an adapter's root too
    assert pc.match(tokens, 3, extra_key=7) == []


def test_lora_layer_triton_equals_torch_path(model):
    layers = wrap_lora_layers(model, max_loras=3, max_lora_rank=8)
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, QKVParallelLinearWithLoRA) and model.model.layers[0].self_attn.qkv_proj is qkv
    g = torch.Generator().manual_seed(1)
    for slot in range(3):
        r = 8 - 2 * slot  # ranks below the max are zero-padded
        lora = LoRAModel(slot + 1, "x", r, 1.0, {name: {i: (torch.randn(r, layer.lora_a.shape[2], generator=g),
                                                           torch.randn(layer.slices[i][1], r, generator=g))
                                                       for i in range(len(layer.slices)) if (i + slot) % 3}
                                                 for name, layer in layers.items()})
        set_adapter(layers, slot, lora)
    x = torch.randn(9, 64, generator=g)
    slots = torch.tensor([0, 1, 2, -1, 2, 1, 0, -1, 1], dtype=torch.int32)
    base = qkv.base_layer(x)
    outs = {}
    for mode in ("torch", "triton"):
        with kernel_mode(mode), set_forward_context(None, lora_mapping=slots):
            outs[mode] = qkv(x)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-4)
    assert torch.equal(outs["torch"][slots < 0], base[slots < 0])
    assert not torch.allclose(outs["torch"][slots >= 0], base[slots >= 0])
    assert torch.equal(qkv(x), base)  # no forward context: the base layer
