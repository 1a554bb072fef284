"""The quantized KV cache (chapter 08): fp8 e4m3 and int8 with calibrated scales, keys per KV head
and channel, values per KV head.

Kernels (on a CPU under Triton's interpreter, natively on a GPU): store_kv quantizes on write with
per-head or per-channel scales, bit for bit as its reference and as an independent oracle (the
nearest of the 255 fp8 codes, Python's round for int8); the decode and prefill kernels read the
quantized cache through shuffled block tables and match their references, which dequantize only the
gathered rows. The attention layer (the keys' per-channel scales folded into the queries) equals
dequantize-then-attend in plain PyTorch, and stops equalling it without the fold. Engine: the pool
holds twice the tokens of bf16 in the same memory, the scales are calibrated per channel (an outlier
channel gets its own), the engine oracle (batched = each request alone) is exact with a quantized
cache, and the embedded model's greedy tokens are compared with the full-precision cache's
(teacher-forced, and free-running: minillm.eval.kv_agreement).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_kernels_attention import DEVICE, GPU, TOL, cu_seqlens, make_cache, qkv_views, randn
from tiny_models import random_model

from minillm import SamplingParams
from minillm.cache import PagedKVCache, bytes_per_token, kv_cache_spec
from minillm.engine import EngineConfig, LLMEngine
from minillm.eval.kv_agreement import cached_logits
from minillm.kernels.flash_attn import flash_attn_varlen, flash_attn_varlen_ref
from minillm.kernels.flash_decode import flash_decode, flash_decode_ref
from minillm.kernels.store_kv import dequantize_kv_ref, quantize_kv_ref, store_kv, store_kv_ref
from minillm.layers.quantization.kv_cache import (
    QMAX,
    calibrate_kv_scales,
    calibration_prompts,
    ensure_kv_scales,
)

FP8, INT8 = torch.float8_e4m3fn, torch.int8
QDTYPES = [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")]
FP8_CODES = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # every e4m3 value (two are NaN)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def head_scales(x: torch.Tensor, dtype, margin: float = 1.0) -> torch.Tensor:
    """Per KV head of x [..., Hkv, D]: margin * absmax / qmax (what calibration computes), fp32."""
    return (x.float().abs().flatten(0, -3).amax(dim=(0, 2)) * margin / QMAX[dtype]).to(x.device)


def channel_scales(x: torch.Tensor, dtype, margin: float = 1.0) -> torch.Tensor:
    """Per KV head and channel of x [..., Hkv, D]: [Hkv, D] fp32 (not paired: any [Hkv, D] must do)."""
    return (x.float().abs().flatten(0, -3).amax(dim=0) * margin / QMAX[dtype]).contiguous()


def oracle_code(x: float, s: float, dtype) -> float:
    """The value one number is stored as, found the slow way: for int8 Python's round (ties to even) of
    x / s clamped to 127; for fp8 the nearest finite e4m3 value (ties: the even code), saturating."""
    y = x / s
    if dtype == INT8:
        return float(round(max(-127.0, min(127.0, y))))
    finite = ~FP8_CODES.isnan()
    dist = (FP8_CODES - y).abs().masked_fill(~finite, float("inf"))
    best = (dist == dist.min()).nonzero().flatten().tolist()
    return FP8_CODES[min(best, key=lambda i: (i & 1, i))].item()  # a tie: the code with an even mantissa


# ---- store_kv: quantize on write -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True], ids=["k-per-head", "k-per-channel"])
def test_store_kv_quantizes_bit_for_bit(seed, dtype, src_dtype, per_channel):
    gen = torch.Generator().manual_seed(seed)
    T, Hq, Hkv, D, num_blocks, block_size = 13, 4, 2, 48, 5, 4
    _q, k, v = qkv_views(gen, T, Hq, Hkv, D, src_dtype)
    k = k * torch.tensor([1.0, 30.0], device=DEVICE, dtype=src_dtype)[:, None]  # heads of different ranges
    k[:, 0, 5] *= 8  # an outlier channel
    # scales a little too small for some rows: those saturate, and saturation must match too
    k_scale = (channel_scales if per_channel else head_scales)(k, dtype, 0.8)
    v_scale = head_scales(v, dtype, 1.3)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:2]] = -1
    slots = slots.to(DEVICE)
    sentinel = torch.full((num_blocks, block_size, Hkv, D), 3.0).to(dtype).to(DEVICE)  # exact in both
    caches = {}
    for name, fn in (("kernel", store_kv), ("reference", store_kv_ref)):
        kc, vc = sentinel.clone(), sentinel.clone()
        fn(k, v, kc, vc, slots, k_scale, v_scale)
        caches[name] = (kc, vc)
    for a, b in zip(caches["kernel"], caches["reference"]):
        assert torch.equal(as_bytes(a), as_bytes(b))
    kc, vc = caches["reference"]
    flat_k, flat_v = kc.view(-1, Hkv, D).float().cpu(), vc.view(-1, Hkv, D).float().cpu()
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        for h in range(Hkv):
            for d in range(0, D, 7):  # a sample of lanes per row, to keep the slow oracle quick
                s_k = k_scale[h, d] if per_channel else k_scale[h]
                assert flat_k[slot, h, d] == oracle_code(k[t, h, d].item(), s_k.item(), dtype)
                assert flat_v[slot, h, d] == oracle_code(v[t, h, d].item(), v_scale[h].item(), dtype)
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert (flat_k[untouched] == 3.0).all() and (flat_v[untouched] == 3.0).all()
    assert flat_k.abs().max() == QMAX[dtype]  # the 0.8 margin saturated the largest keys


def test_store_kv_quantized_refuses_bad_scales():
    k = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, dtype=INT8, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    for fn in (store_kv, store_kv_ref):
        with pytest.raises(ValueError, match="needs k_scale"):
            fn(k, k, cache, cache.clone(), slots)
        with pytest.raises(ValueError, match=r"v_scale must be float32 of shape \[num_kv_heads\] = \(2,\)"):
            fn(k, k, cache, cache.clone(), slots, ones, torch.ones(3, device=DEVICE))
        with pytest.raises(ValueError, match="dequantize an fp8 or int8 cache"):
            fn(k, k, torch.zeros(2, 4, 2, 16, device=DEVICE), torch.zeros(2, 4, 2, 16, device=DEVICE), slots, ones, ones)
        with pytest.raises(ValueError, match=r"per-channel k_scale must have shape \[num_kv_heads, head_dim\] = "
                                             r"\(2, 16\), got \(2, 15\)"):
            fn(k, k, cache, cache.clone(), slots, torch.ones(2, 15, device=DEVICE), ones)
        with pytest.raises(ValueError, match="per-channel k_scale must be contiguous"):
            fn(k, k, cache, cache.clone(), slots, torch.ones(16, 2, device=DEVICE).t(), ones)
        with pytest.raises(ValueError, match=r"k_scale must be float32 of shape \[num_kv_heads\] = \(2,\)"):
            fn(k, k, cache, cache.clone(), slots, torch.ones(2, 16, dtype=torch.float64, device=DEVICE), ones)


# ---- attention over a quantized cache --------------------------------------------------------------


def quantized_cache(gen, k_lens, Hkv, D, dtype, block_size):
    """A full-precision random cache (shuffled block table), its quantized copy and the scales."""
    k, v, table = make_cache(gen, k_lens, Hkv, D, torch.float32, block_size)
    k = k * torch.linspace(0.5, 4.0, Hkv, device=DEVICE)[:, None]  # per-head ranges differ
    k_scale, v_scale = head_scales(k, dtype, 1.1), head_scales(v, dtype, 1.1)
    return (k, v), (quantize_kv_ref(k, k_scale, dtype), quantize_kv_ref(v, v_scale, dtype)), (k_scale, v_scale), table


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("block_size,Hq,Hkv,D,seq_lens,window,num_splits,q_dtype", [
    pytest.param(16, 6, 2, 64, [1, 37, 70], None, 3, torch.float32, id="paged16-gqa3-splits3"),
    pytest.param(5, 4, 1, 64, [33, 8], 7, None, torch.float32, id="paged5-gqa4-window"),
    pytest.param(16, 8, 2, 32, [45, 3], None, 1, torch.float16, id="fp16-single-split"),
])
def test_flash_decode_reads_a_quantized_cache(seed, dtype, block_size, Hq, Hkv, D, seq_lens, window, num_splits,
                                              q_dtype):
    gen = torch.Generator().manual_seed(seed)
    (k, v), (kq, vq), (ks, vs), table = quantized_cache(gen, seq_lens, Hkv, D, dtype, block_size)
    q = randn(gen, len(seq_lens), Hq, D, dtype=q_dtype)
    seqused = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = dict(sliding_window=window, num_splits=num_splits)
    got = flash_decode(q, kq, vq, seqused, table, k_scale=ks, v_scale=vs, **kw)
    want = flash_decode_ref(q, kq, vq, seqused, table, k_scale=ks, v_scale=vs, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[q_dtype], rtol=TOL[q_dtype])
    # and the reference is what attention over the dequantized cache gives: the scales are applied
    deq = flash_decode_ref(q.float(), dequantize_kv_ref(kq, ks), dequantize_kv_ref(vq, vs), seqused, table, **kw)
    torch.testing.assert_close(want.float(), deq, atol=TOL[q_dtype], rtol=TOL[q_dtype])
    # close to the unquantized cache's result (fp8: 3 mantissa bits, int8: 255 levels per head)
    full = flash_decode_ref(q.float(), k, v, seqused, table, **kw)
    err = (want.float() - full).norm() / full.norm()
    assert err < (0.08 if dtype == FP8 else 0.03), err


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("block_size,Hq,Hkv,D,q_lens,k_lens,window", [
    pytest.param(16, 6, 2, 64, [20, 3, 1], [45, 3, 30], None, id="paged16-gqa3-prefix"),
    pytest.param(7, 4, 4, 32, [30, 7], [61, 7], 12, id="paged7-window"),
])
def test_flash_attn_reads_a_quantized_cache(seed, dtype, block_size, Hq, Hkv, D, q_lens, k_lens, window):
    gen = torch.Generator().manual_seed(seed)
    q, _, _ = qkv_views(gen, sum(q_lens), Hq, Hkv, D, torch.float32)
    _, (kq, vq), (ks, vs), table = quantized_cache(gen, k_lens, Hkv, D, dtype, block_size)
    args = (q, kq, vq, cu_seqlens(q_lens), max(q_lens))
    kw = dict(seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=DEVICE), block_table=table,
              sliding_window=window, return_lse=True, k_scale=ks, v_scale=vs)
    out, lse = flash_attn_varlen(*args, **kw)
    want_out, want_lse = flash_attn_varlen_ref(*args, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_attention_kernels_refuse_a_quantized_cache_without_scales():
    gen = torch.Generator().manual_seed(0)
    _, (kq, vq), (ks, vs), table = quantized_cache(gen, [9], 2, 32, INT8, 16)
    q = randn(gen, 1, 2, 32)
    seqused = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    for fn in (flash_decode, flash_decode_ref):
        with pytest.raises(ValueError, match="needs k_scale"):
            fn(q, kq, vq, seqused, table)
    with pytest.raises(ValueError, match="is read from a cache"):
        flash_attn_varlen_ref(q, kq[0], vq[0], cu_seqlens([1]), 1, cu_seqlens_k=cu_seqlens([9]), k_scale=ks,
                              v_scale=vs)


def layer_over_quantized_cache(q, k, v, dtype, k_scale, v_scale, split: int, block_size: int = 4):
    """An Attention layer over a fresh quantized cache: a prefill of the first `split` tokens, then one
    decode step per remaining token. q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    from minillm.layers import AttentionMetadata
    from minillm.layers.attention import Attention

    T, Hq, D = q.shape
    Hkv = k.shape[1]
    layer = Attention(Hq, D, Hkv).to(DEVICE)
    layer.k_scale.copy_(k_scale)
    layer.v_scale.copy_(v_scale)
    layer.kv_scale_qmax = QMAX[dtype]
    num_blocks = -(-T // block_size) + 1
    layer.kv_cache = tuple(torch.zeros(num_blocks, block_size, Hkv, D, dtype=dtype, device=DEVICE) for _ in "kv")
    table = (torch.randperm(num_blocks - 1) + 1).int().to(DEVICE)  # shuffled, block 0 unused
    slots = (table.long()[torch.arange(T, device=DEVICE) // block_size] * block_size
             + torch.arange(T, device=DEVICE) % block_size)
    outs = []
    for lo, hi in [(0, split)] + [(t, t + 1) for t in range(split, T)]:
        meta = AttentionMetadata.from_seq_lens([hi - lo], DEVICE)
        meta.seq_lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        meta.block_table = table[None]
        meta.slot_mapping = slots[lo:hi]
        outs.append(layer(q[lo:hi], k[lo:hi], v[lo:hi], torch.arange(lo, hi, device=DEVICE), meta))
    return torch.cat(outs).view(T, Hq, D)


def dequantize_then_attend(q, k, v, dtype, k_scale, v_scale) -> torch.Tensor:
    """The oracle, plain PyTorch: K and V rounded as the cache rounds them, read back in fp32, and
    causal attention over them (each KV head repeated for its query heads)."""
    kd = dequantize_kv_ref(quantize_kv_ref(k, k_scale, dtype), k_scale)  # [T, Hkv, D] fp32
    vd = dequantize_kv_ref(quantize_kv_ref(v, v_scale, dtype), v_scale)
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = q.float().transpose(0, 1), kd.repeat_interleave(group, 1).transpose(0, 1), \
        vd.repeat_interleave(group, 1).transpose(0, 1)  # [H, T, D]
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)


def fold_case(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    T, Hq, Hkv, D = 21, 6, 2, 32
    q, k, v = (randn(gen, T, h, D) for h in (Hq, Hkv, Hkv))
    k = k * (1 + 9 * (torch.rand(Hkv, D, generator=gen) < 0.1)).to(DEVICE)  # a few outlier channels
    return q, k, v, channel_scales(k, dtype, 1.1), head_scales(v, dtype, 1.1)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_per_channel_key_scales_fold_into_the_query(seed, dtype, mode):
    """Fresh random q, k, v with outlier key channels and per-channel key scales: the layer (k / s
    stored, q * s attended with a unit K scale) gives dequantize-then-attend's output, in the prefill
    and in the decode steps, through the PyTorch references and through the Triton kernels."""
    from minillm.layers.backend import kernel_mode

    q, k, v, k_scale, v_scale = fold_case(seed, dtype)
    with kernel_mode(mode):
        got = layer_over_quantized_cache(q, k, v, dtype, k_scale, v_scale, split=13)
    want = dequantize_then_attend(q, k, v, dtype, k_scale, v_scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_without_the_query_fold_the_layer_is_wrong(seed, monkeypatch):
    """The mutation the test above must catch: the keys stored as k / s, but q not multiplied by s."""
    import minillm.layers.attention as attention

    q, k, v, k_scale, v_scale = fold_case(seed, INT8)
    monkeypatch.setattr(attention, "fold_k_scale", lambda q, k_scale: q)
    got = layer_over_quantized_cache(q, k, v, INT8, k_scale, v_scale, split=13)
    want = dequantize_then_attend(q, k, v, INT8, k_scale, v_scale)
    assert (got - want).abs().max() > 1e-2


# ---- spec, sizing, calibration -------------------------------------------------------------------


def tiny(seed: int, **overrides):
    return random_model(random.Random(seed), **overrides)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "int8"])
def test_the_pool_holds_twice_the_tokens_of_bf16(name):
    model, _config = tiny(1)
    bf16, quant = kv_cache_spec(model, torch.bfloat16), kv_cache_spec(model, QMAX_DTYPE[name])
    assert all(s.has_scales for s in quant) and not any(s.has_scales for s in bf16)
    assert 2 * bytes_per_token(quant) == bytes_per_token(bf16)
    budget = 1 << 20
    blocks = {tag: budget // PagedKVCache.block_bytes(s, 16) for tag, s in (("bf16", bf16), ("q", quant))}
    assert blocks["q"] in (2 * blocks["bf16"], 2 * blocks["bf16"] + 1)
    # the engine sizes its pool from the spec: on a CPU a fixed budget, so fp32 -> one byte is 4x
    sizes = {d: EngineConfig(kv_cache_dtype=d).resolve(model) for d in ("auto", name)}
    assert sizes[name].num_gpu_blocks // sizes["auto"].num_gpu_blocks == 4
    cache = PagedKVCache(list(sizes[name].kv_cache_spec), 4, 16, "cpu")
    assert cache.k_caches[0].dtype == QMAX_DTYPE[name] and cache.nbytes == 4 * 16 * bytes_per_token(quant)


QMAX_DTYPE = {"fp8": FP8, "fp8_e4m3": FP8, "int8": INT8}


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', 'int8', not 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="not 'FP8'"):
        EngineConfig(kv_cache_dtype="FP8")


def test_fp8_kv_on_a_gpu_without_fp8_is_refused(monkeypatch):
    """An A100 (compute capability 8.0) has no fp8 conversions: a clear error naming the GPU and int8."""
    from minillm.layers.quantization.kv_cache import check_kv_cache_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs .*>= 8.9.*A100.* has 8.0: use 'int8'"):
        check_kv_cache_device(FP8, torch.device("cuda"))
    check_kv_cache_device(INT8, torch.device("cuda"))  # int8 runs anywhere
    check_kv_cache_device(FP8, torch.device("cpu"))  # the references convert fp8 in software


def test_calibration_sets_per_channel_key_scales(seed):
    model, config = tiny(seed, num_heads=4, num_kv_heads=2, architecture="llama")
    layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
    D = config.head_dim
    assert all(layer.kv_scale_qmax is None for layer in layers)
    prompts = calibration_prompts(vocab_size=config.vocab_size, count=3, length=20)
    stats = calibrate_kv_scales(model, prompts, FP8)
    assert stats["k_absmax"].shape == (len(layers), 2, D) and stats["v_absmax"].shape == (len(layers), 2)
    for i, layer in enumerate(layers):
        assert torch.equal(layer.k_scale, stats["k_absmax"][i] * 1.25 / 448)
        assert torch.equal(layer.v_scale, stats["v_absmax"][i] * 1.25 / 448)
        assert (layer.k_scale > 0).all() and (layer.v_scale > 0).all()
        # a RoPE pair (d, d + D/2) shares one scale; the channels of a head do not all share one
        assert torch.equal(layer.k_scale[:, : D // 2], layer.k_scale[:, D // 2:])
        assert (layer.k_scale.amax(dim=1) > layer.k_scale.amin(dim=1)).all()
    # the absmax really is per channel pair: record K by hand at layer 0 and compare
    k_seen = []
    hook = layers[0].register_forward_pre_hook(lambda mod, args: k_seen.append(args[1].abs().amax(dim=0)))
    with torch.inference_mode():
        from minillm.layers import AttentionMetadata

        for p in prompts:
            model(torch.tensor(p), torch.arange(len(p)), AttentionMetadata.from_seq_lens([len(p)]))
    hook.remove()
    k_amax = torch.stack(k_seen).amax(dim=0)  # [Hkv, D]
    torch.testing.assert_close(stats["k_absmax"][0], torch.maximum(k_amax, k_amax.roll(D // 2, dims=1)))
    per_head = calibrate_kv_scales(model, prompts, FP8, per_channel_keys=False)["k_absmax"]  # for comparison
    torch.testing.assert_close(per_head, stats["k_absmax"].amax(-1, keepdim=True).expand_as(per_head))
    calibrate_kv_scales(model, prompts, FP8)
    fp8_scales = [(layer.k_scale.clone(), layer.v_scale.clone()) for layer in layers]
    ensure_kv_scales(model, INT8)  # calibrated for fp8: only qmax changes
    for layer, (k_s, v_s) in zip(layers, fp8_scales):
        torch.testing.assert_close(layer.k_scale, k_s * 448 / 127)
        torch.testing.assert_close(layer.v_scale, v_s * 448 / 127)
        assert layer.kv_scale_qmax == 127


def test_an_outlier_key_channel_gets_its_own_scale(seed):
    """Give channel c of KV head 1's keys a row of the K projection 20x longer than the head's longest:
    in layer 0 that channel and its RoPE partner get a scale far above every scale the head had, and
    every other channel's scale is what it was. (One scale per head would have grown for all D.)"""
    model, config = tiny(seed, num_heads=4, num_kv_heads=2, architecture="llama", qk_norm=False)  # no per-head norm
    D, Hq = config.head_dim, config.num_heads
    c = random.Random(seed).randrange(D // 2)
    prompts = calibration_prompts(vocab_size=config.vocab_size, count=3, length=20)
    before = calibrate_kv_scales(model, prompts, INT8)["k_absmax"][0]  # [Hkv, D] of layer 0
    qkv = next(m for m in model.modules() if hasattr(m, "qkv_proj")).qkv_proj
    row = (Hq + 1) * D + c  # K rows follow the Hq * D query rows; KV head 1, channel c
    head_rows = qkv.weight[(Hq + 1) * D:(Hq + 2) * D]  # [D, hidden]: KV head 1's K rows
    with torch.no_grad():
        qkv.weight[row] *= 20 * head_rows.norm(dim=1).max() / qkv.weight[row].norm()
    after = calibrate_kv_scales(model, prompts, INT8)["k_absmax"][0]
    pair = [c, c + D // 2]
    assert (after[1, pair] > 4 * before[1].max()).all(), (after[1, pair], before[1])
    others = torch.ones(2, D, dtype=torch.bool)
    others[1, pair] = False
    assert torch.equal(after[others], before[others])


def test_an_uncalibrated_layer_refuses_a_quantized_cache():
    model, _ = tiny(3)
    cache = PagedKVCache(kv_cache_spec(model, INT8), 4, 8, "cpu")
    cache.bind(model)
    from minillm.layers import AttentionMetadata

    meta = AttentionMetadata.from_seq_lens([3])
    meta.seq_lens = torch.tensor([3], dtype=torch.int32)
    meta.block_table = torch.tensor([[1]], dtype=torch.int32)
    meta.slot_mapping = torch.tensor([8, 9, 10])
    with pytest.raises(RuntimeError, match="never calibrated"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), meta)


def test_block_copies_and_swaps_move_fp8_bytes(seed):
    model, _ = tiny(seed)
    cache = PagedKVCache(kv_cache_spec(model, FP8), 6, 4, "cpu", num_cpu_blocks=3)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(FP8))
    before = as_bytes(cache.k_caches[0]).clone()
    cache.copy_blocks([(1, 4)])
    cache.swap_out([(2, 0)])
    cache.swap_in([(0, 5)])
    after = as_bytes(cache.k_caches[0])
    assert torch.equal(after[4], before[1]) and torch.equal(after[5], before[2])


# ---- the engine ------------------------------------------------------------------------------------


def run_engine(model, tok, requests, config: EngineConfig) -> list[list[int]]:
    engine = LLMEngine(model, tok, [], config)
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
    return [got[f"r{i}"] for i in range(len(requests))]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_engine_batched_equals_alone_with_a_quantized_cache(seed, tok, kv_cache_dtype):
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(max_tokens=rng.randrange(1, 16), temperature=0.0)) for _ in range(6)]
    ensure_kv_scales(model, QMAX_DTYPE[kv_cache_dtype])
    want = [run_engine(model, tok, [r], EngineConfig(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=64))[0]
            for r in requests]
    block_size = rng.choice([1, 4, 16])
    need = max(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in requests)  # the longest request's blocks
    ec = EngineConfig(kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_gpu_blocks=need + 1 + rng.randrange(0, 24),
                      num_cpu_blocks=64, preemption_mode=rng.choice(["recompute", "swap"]),
                      enable_prefix_caching=rng.choice([None, "hash"]), max_num_batched_tokens=rng.randrange(8, 40),
                      max_num_seqs=rng.randrange(2, 6))
    assert run_engine(model, tok, requests, ec) == want, ec
    # and the quantized cache really changed something: the full-precision engine is a different run
    layer = next(m for m in model.modules() if hasattr(m, "kv_cache"))
    assert layer.kv_scale_qmax == QMAX[QMAX_DTYPE[kv_cache_dtype]]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_padded_steps_through_the_triton_kernels_with_a_quantized_cache(seed, tok, kv_cache_dtype):
    """The CUDA-graph path's padded steps through minillm's Triton kernels (the interpreter on a CPU,
    natively on a GPU) over a quantized cache: every request gets the tokens the PyTorch references
    give it alone."""
    import os

    from minillm.layers.backend import kernel_mode

    rng = random.Random(seed)
    model, config = random_model(rng)
    if os.environ.get("TRITON_INTERPRET") != "1":
        model = model.to("cuda")
    ensure_kv_scales(model, QMAX_DTYPE[kv_cache_dtype])
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 30))],
                 SamplingParams(max_tokens=rng.randrange(2, 8), temperature=0.0)) for _ in range(4)]
    with kernel_mode("torch"):
        want = [run_engine(model, tok, [r], EngineConfig(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=64,
                                                          enforce_eager=True))[0] for r in requests]
    engine = LLMEngine(model, tok, [], EngineConfig(kv_cache_dtype=kv_cache_dtype, block_size=4, num_gpu_blocks=64,
                                                    max_num_batched_tokens=24, max_num_seqs=3))
    engine.runner.graphs = engine.runner.make_graphs(capture=False)  # the padded static buffers, eagerly
    with kernel_mode("triton"):
        for i, (p, sp) in enumerate(requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        got = {}
        while engine.has_unfinished_requests():
            got |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert [got[f"r{i}"] for i in range(len(requests))] == want
    assert engine.cache.k_caches[0].dtype == QMAX_DTYPE[kv_cache_dtype]
    assert {shape.max_seqlen == 1 for shape in engine.runner.graphs.replays} == {True, False}


# Held-out (question, answer) pairs, none of them calibration text: the answer is the context the
# greedy predictions are compared on, token by token.
QA = [
    ("What is a lighthouse for?", "A lighthouse marks a dangerous coast or a safe harbour entrance. Its lamp, "
     "magnified by a large lens, flashes in a pattern that sailors look up on their charts, so that at night "
     "they know not only that land is near but exactly which point of land they are looking at. Many are now "
     "automatic, and the old keepers' cottages have become museums."),
    ("How do bees make honey?", "Worker bees collect nectar from flowers and carry it back to the hive in a "
     "special stomach. There they pass it from bee to bee, adding enzymes, and spread it over the wax cells. "
     "Fanning their wings, they evaporate most of the water until the thick honey can be sealed with wax "
     "and stored for the winter, when no flowers bloom."),
    ("Why do we have leap years?", "The Earth takes about 365 days and six hours to go around the Sun. A "
     "calendar of exactly 365 days would drift by almost a day every four years, so every fourth year gets an "
     "extra day in February, with a few exceptions for century years to keep the seasons in place for "
     "centuries."),
    ("Describe a good morning routine.", "Wake up at the same time every day, drink a glass of water and open "
     "the curtains to let in daylight. Stretch or walk for ten minutes, eat a simple breakfast with some "
     "protein, and look at your plan for the day before you open your email or any messages. A calm "
     "start makes the rest of the day easier."),
    ("What does a compiler do?", "A compiler reads a program written in a high-level language and translates "
     "it into instructions a machine can run. It checks the syntax and the types, builds an intermediate "
     "representation, optimizes it by removing redundant work, and finally emits machine code or bytecode. Good "
     "compilers also explain clearly what went wrong when a program has an error."),
    ("Tell me about the Moon.", "The Moon is the Earth's only natural satellite, about a quarter of its "
     "diameter. It always shows the same face to us because it rotates once for every orbit. Its gravity "
     "raises the ocean tides, and its craters record billions of years of impacts from space. Twelve "
     "astronauts walked on its surface between 1969 and 1972."),
    ("How should I store fresh bread?", "Keep bread at room temperature in a paper bag or a bread box for a "
     "day or two; plastic keeps it soft but makes the crust soggy. Never put it in the refrigerator, where it "
     "goes stale faster. For longer storage, slice it and freeze it, then toast the slices straight from frozen "
     "whenever you need them."),
    ("Why is exercise good for the heart?", "Regular exercise makes the heart muscle stronger, so it pumps more "
     "blood with each beat and can beat more slowly at rest. It lowers blood pressure, improves cholesterol "
     "levels and helps control weight, which together reduce the risk of heart disease and stroke. Even "
     "a brisk thirty-minute walk on most days of the week makes a measurable difference."),
]


@pytest.fixture(scope="module")
def embedded_fp32():
    """The embedded model (fp32 on a CPU) and each QA pair as (context ids, answer ids), 64 answer tokens."""
    from minillm import LLM

    llm = LLM(dtype="float32", device="cpu", enable_kv_cache=False)  # the CPU measurement, on any machine
    runs = []
    for question, answer in QA:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=True)
        runs.append((prompt, llm.tokenizer.encode(answer)[:64]))
    assert all(len(a) == 64 for _, a in runs)
    greedy = [cached_logits(llm.model, p + a, torch.float32)[len(p) - 1:-1].argmax(-1) for p, a in runs]
    return llm, runs, greedy


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_embedded_model_greedy_tokens_agree_with_full_precision_kv(embedded_fp32, kv_cache_dtype):
    """The embedded model's greedy token at each of 64 positions of 8 held-out answers, given the same
    context, with a quantized cache vs the fp32 cache: >= 90 % the same (teacher-forced; each row of
    logits is one greedy decision). Free-running generations are compared below: there one flipped
    near-tie changes everything after it."""
    llm, runs, greedy = embedded_fp32
    dtype = QMAX_DTYPE[kv_cache_dtype]
    calibrate_kv_scales(llm.model, calibration_prompts(llm.tokenizer), dtype)
    same = total = 0
    for (prompt, answer), want in zip(runs, greedy):
        got = cached_logits(llm.model, prompt + answer, dtype)[len(prompt) - 1:-1].argmax(-1)  # [64]
        same += (got == want).sum().item()
        total += len(answer)
    print(f"\n{kv_cache_dtype} KV: {same}/{total} = {same / total:.1%} of the fp32-KV greedy tokens")
    assert total == 512 and same / total >= 0.90


@pytest.fixture(scope="module")
def tiny_free_running(tiny_chat_model):
    """kv_greedy_agreement on a tiny random llama (fp32, CPU): what the report must hold is the same for
    any model, and this one takes seconds where the embedded model takes half an hour on a CI CPU."""
    from minillm import LLM
    from minillm.eval.kv_agreement import kv_greedy_agreement

    llm = LLM(str(tiny_chat_model), dtype="float32", device="cpu", enable_kv_cache=False)
    return {r.kv_cache_dtype: r for r in kv_greedy_agreement(llm, max_tokens=TINY_FREE_TOKENS)}


TINY_FREE_TOKENS = 12


def test_free_running_agreement_is_measured(tiny_free_running):
    """What the measurement reports is consistent: every prompt's tokens compared, a first difference
    where the tokens first differ, the reference's top-2 margin there (>= 0)."""
    from minillm.eval.kv_agreement import BF16_CONTROL, PROMPTS

    assert set(tiny_free_running) == {"fp8", "int8", BF16_CONTROL}
    for r in tiny_free_running.values():
        assert r.tokens == len(PROMPTS) * TINY_FREE_TOKENS and len(r.first_divergence) == len(PROMPTS)
        assert 0 <= r.same_position <= 1 and r.before_first_divergence <= r.same_position
        assert 0 <= r.teacher_forced_same <= 1 and r.teacher_forced_kl >= 0
        for first, margin in zip(r.first_divergence, r.divergence_margin):
            assert (margin is None) == (first == TINY_FREE_TOKENS) and (margin is None or margin >= 0)


# The embedded model's free-running measurement is 4 x 8 x 64 fp32 decode steps plus teacher-forced
# passes: ~29 minutes of one CI worker (measured 1,718 s, 2026-12-03), for a test whose outcome is known
# (xfail: issue 16's target is not reached). It runs where it is cheap -- on the GPU machine
# (.ci/gpu.sh runs the whole suite) or wherever MINILLM_SLOW_QUANT=1 is set, as test_awq_gptq's
# embedded-model calibrations do; the CPU CI runs the report's consistency on the tiny model above.
slow_free_running = pytest.mark.skipif(
    not (os.environ.get("MINILLM_SLOW_QUANT") or torch.cuda.is_available()),
    reason="the embedded model's free-running KV agreement takes ~30 min on a CI CPU: set MINILLM_SLOW_QUANT=1 "
           "(the GPU script runs it)")


@pytest.fixture(scope="module")
def free_running(embedded_fp32):
    """kv_greedy_agreement on the embedded model (fp32, CPU): 8 prompts x 64 greedy tokens, fp8 and
    int8 caches and the bf16 control vs the fp32 cache."""
    from minillm.eval.kv_agreement import kv_greedy_agreement

    results = {r.kv_cache_dtype: r for r in kv_greedy_agreement(embedded_fp32[0])}
    for r in results.values():
        print(f"\n{r.kv_cache_dtype}: {r.same_position:.1%} of {r.tokens} tokens identical, "
              f"{r.before_first_divergence:.1%} before the first difference; first differences at "
              f"{r.first_divergence}, fp32 margin there {[m if m is None else round(m, 3) for m in r.divergence_margin]}; "
              f"teacher-forced {r.teacher_forced_same:.1%} the same, KL {r.teacher_forced_kl:.5f}")
    return results


@pytest.mark.slow
@slow_free_running
def test_embedded_free_running_agreement_is_measured(free_running):
    """The same consistency on the embedded model's 8 x 64 tokens (the numbers the xfail below is about)."""
    from minillm.eval.kv_agreement import BF16_CONTROL

    assert set(free_running) == {"fp8", "int8", BF16_CONTROL}
    for r in free_running.values():
        assert r.tokens == 512 and len(r.first_divergence) == 8 and 0 <= r.same_position <= 1
        assert r.before_first_divergence <= r.same_position
        for first, margin in zip(r.first_divergence, r.divergence_margin):
            assert (margin is None) == (first == 64) and (margin is None or margin >= 0)


@pytest.mark.slow
@slow_free_running
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 16's target (>= 90 % identical free-running greedy tokens, 64 tokens x 8 prompts) is not reached: "
    "measured on CPU, fp32 model, per-channel key scales (2026-11-25): fp8 26.6 %, int8 31.8 % (one key "
    "scale per head: 23.0 %, 25.0 %); a bf16 cache (the control) gets 88.7 %: a flipped near-tie changes "
    "every later token"))
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_free_running_greedy_tokens_agree_with_full_precision_kv(free_running, kv_cache_dtype):
    assert free_running[kv_cache_dtype].same_position >= 0.90


def test_kv_greedy_agreement_refuses_bad_arguments():
    from minillm.eval.kv_agreement import kv_greedy_agreement

    with pytest.raises(ValueError, match="give quantized ones .* not 'auto'"):
        kv_greedy_agreement(None, kv_cache_dtypes=("auto",))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_greedy_agreement(None, kv_cache_dtypes=("fp4",))
    with pytest.raises(ValueError, match="prompts must be a non-empty list of non-empty strings"):
        kv_greedy_agreement(None, prompts=["hi", ""])
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, not 0"):
        kv_greedy_agreement(None, max_tokens=0)


def test_cli_takes_kv_cache_dtype():
    from minillm.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp4"])


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (runs on the GPU machine)")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_cuda_graphs_capture_with_a_quantized_cache(seed, tok, kv_cache_dtype):
    """Scales are tensors: the graphs replay them by address, and graph = eager."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    model = model.cuda()
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(max_tokens=12, temperature=0.0)) for _ in range(5)]
    eager = run_engine(model, tok, requests, EngineConfig(kv_cache_dtype=kv_cache_dtype, enforce_eager=True,
                                                          num_gpu_blocks=64))
    graphed = run_engine(model, tok, requests, EngineConfig(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=64))
    assert graphed == eager


def test_serve_takes_kv_cache_dtype():
    from minillm.cli import build_parser
    from minillm.entrypoints.openai.cli_args import engine_kwargs

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "int8"
    assert "kv_cache_dtype" not in engine_kwargs(build_parser().parse_args(["serve"]))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])))
