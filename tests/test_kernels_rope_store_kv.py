"""The fused RoPE + KV-cache write (+ QK-norm, + quantized cache) against two oracles, on fresh random
inputs with odd sizes and padding rows (slot -1):
- the unfused kernels it replaces (RMSNorm per head, rotary, store_kv, the scale fold), which round in
  the same places: the fused kernel must store the same bits (on inputs where fp32 sums are exact);
- the plain-PyTorch references, which round after every op: within an ulp of the inputs.
On a CPU under Triton's interpreter with small shapes; on a GPU with SmolLM2's and Qwen3's heads.
"""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels.rms_norm import rms_norm
from minillm.kernels.rope_store_kv import rope_store_kv, rope_store_kv_ref
from minillm.kernels.rotary import apply_rotary_
from minillm.kernels.store_kv import dequantize_kv_ref, store_kv

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grid(g, *shape, dtype):
    """Multiples of 1/16 in [-4, 4]: exact in every dtype, and so are fp32 sums of their squares."""
    return (torch.randint(-64, 65, shape, generator=g) / 16).to(dtype).to(DEVICE)


def _case(g, T, Hq, Hkv, D, dtype, num_blocks=5, block_size=3, pad=(1,)):
    """qkv as the projection makes it, cos/sin of random angles, caches and slots (pad rows -1)."""
    qkv = _grid(g, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)
    angles = torch.rand(T, D, generator=g) * 200 - 100  # an independent angle per coordinate
    cos, sin = angles.cos().to(dtype).to(DEVICE)[:, None, :], angles.sin().to(dtype).to(DEVICE)[:, None, :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    for t in pad:
        if t < T:
            slots[t] = -1
    caches = [torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    return qkv, q, k, v, cos, sin, caches, slots.to(DEVICE)


def _norm_weights(g, D, dtype):
    return [(torch.rand(D, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]


def _unfused(q, k, v, cos, sin, kc, vc, slots, qw, kw, eps, k_scale=None, v_scale=None, fold=False):
    """The launches the fused kernel replaces, in the model's order; returns the new q."""
    q, k = q.clone(), k.clone()
    if qw is not None:
        T, Hq, D = q.shape
        q = rms_norm(q.reshape(-1, D), qw, eps).view(T, Hq, D)
        k = rms_norm(k.reshape(-1, D), kw, eps).view(T, -1, D)
    apply_rotary_(q, k, cos, sin)
    store_kv(k, v, kc, vc, slots, k_scale, v_scale)
    if fold:
        Hkv = k_scale.shape[0]
        groups = q.unflatten(1, (Hkv, q.shape[1] // Hkv))
        out = torch.empty(groups.shape, dtype=q.dtype, device=q.device)
        torch.mul(groups, k_scale[:, None, :], out=out)
        q = out.flatten(1, 2)
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (5, 6, 2, 24), (7, 5, 5, 16)])
def test_same_bits_as_the_unfused_kernels(seed, dtype, qk_norm, T, Hq, Hkv, D):
    g = torch.Generator().manual_seed(seed)
    _, q, k, v, cos, sin, (kc, vc), slots = _case(g, T, Hq, Hkv, D, dtype, pad=(1, 4))
    qw, kw = _norm_weights(g, D, dtype) if qk_norm else (None, None)
    kc2, vc2 = kc.clone(), vc.clone()
    k0, v0 = k.clone(), v.clone()
    want_q = _unfused(q, k, v, cos, sin, kc2, vc2, slots, qw, kw, 1e-6)
    out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)
    assert out is q  # rotated in place, in the qkv buffer
    assert torch.equal(k, k0) and torch.equal(v, v0)  # k and v only read
    assert torch.equal(vc, vc2)  # v copied; padding rows wrote nothing either
    if dtype == torch.float32 and not INTERPRETED:
        # fp32 on a GPU keeps no rounding to hide where the compiler contracted a * cos - b * sin into
        # an FMA, and the two kernels may contract it differently (seen on an H100): an ulp or two of
        # the terms. Half precision rounds that away (exact above and below).
        for got, want in ((q, want_q), (kc, kc2)):
            torch.testing.assert_close(got, want, rtol=0, atol=4 * torch.finfo(dtype).eps * want.abs().max().item())
        return
    assert torch.equal(q, want_q)
    assert torch.equal(kc, kc2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_close_to_the_pytorch_reference(seed, dtype, qk_norm):
    g = torch.Generator().manual_seed(seed)
    T, Hq, Hkv, D = 6, 6, 3, 32
    _, q, k, v, cos, sin, (kc, vc), slots = _case(g, T, Hq, Hkv, D, dtype, pad=(0, 5))
    q = q + 0  # random values off the grid too: a real projection's output
    qw, kw = _norm_weights(g, D, dtype) if qk_norm else (None, None)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref_q = rope_store_kv_ref(q, k, v, cos, sin, kc_ref, vc_ref, slots, q_norm_weight=qw, k_norm_weight=kw)
    rope_store_kv(q, k, v, cos, sin, kc, vc, slots, q_norm_weight=qw, k_norm_weight=kw)
    # The reference rounds after each multiply and the add; the kernel once: an ulp or two of the
    # inputs' magnitude (and the norm's rounded output, in bf16 truncated by the interpreter).
    ulp = torch.finfo(dtype).eps
    for out, ref in ((q, ref_q), (kc, kc_ref), (vc, vc_ref)):
        torch.testing.assert_close(out, ref, rtol=0, atol=8 * ulp * ref.abs().max().item())
    assert torch.equal(vc, vc_ref)  # v is copied, not computed


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantized_cache(seed, cache_dtype, per_channel):
    g = torch.Generator().manual_seed(seed)
    T, Hq, Hkv, D = 5, 6, 2, 16
    dtype = torch.float32  # fp8 codes differ by a step if the rotated k differs by an ulp: keep rounding exact
    _, q, k, v, cos, sin, _, slots = _case(g, T, Hq, Hkv, D, dtype, pad=(2,))
    kc = torch.zeros(5, 3, Hkv, D, dtype=cache_dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    k_scale = (torch.rand(Hkv, D, generator=g) + 0.01 if per_channel else torch.rand(Hkv, generator=g) + 0.01)
    k_scale, v_scale = k_scale.to(DEVICE), (torch.rand(Hkv, generator=g) + 0.01).to(DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    kw = dict(k_scale=k_scale, v_scale=v_scale, fold_k_scale=per_channel)
    want_q = _unfused(q, k, v, cos, sin, kc2, vc2, slots, None, None, 1e-6, k_scale, v_scale, per_channel)
    rope_store_kv(q, k, v, cos, sin, kc, vc, slots, **kw)
    assert torch.equal(q, want_q)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    # ... and the codes decode to the rotated keys within half a quantization step (int8) or 2^-4 (fp8)
    ref_kc, ref_vc = kc.clone().zero_(), vc.clone().zero_()
    rope_store_kv_ref(q.clone(), k, v, cos, sin, ref_kc, ref_vc, slots, **kw)
    got = dequantize_kv_ref(kc, k_scale)
    want = dequantize_kv_ref(ref_kc, k_scale)
    torch.testing.assert_close(got, want, rtol=0.07, atol=float(k_scale.max()))


def test_all_padding_writes_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    _, q, k, v, cos, sin, (kc, vc), slots = _case(g, 3, 4, 2, 16, torch.float32, pad=(0, 1, 2))
    kc0, vc0 = kc.clone(), vc.clone()
    rope_store_kv(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_bad_input_is_refused():
    T, Hq, Hkv, D = 2, 4, 2, 16
    q, k, v = (torch.randn(T, h, D, device=DEVICE) for h in (Hq, Hkv, Hkv))
    cos = sin = torch.randn(T, 1, D, device=DEVICE)
    kc = vc = torch.zeros(2, 4, Hkv, D, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_store_kv(q[..., :15], k[..., :15], v[..., :15], cos[..., :15], sin[..., :15],
                      kc[..., :15].contiguous(), vc[..., :15].contiguous(), slots)
    with pytest.raises(ValueError, match="come together"):
        rope_store_kv(q, k, v, cos, sin, kc, vc, slots, q_norm_weight=torch.ones(D, device=DEVICE))
    with pytest.raises(ValueError, match="q_norm_weight must be a"):
        rope_store_kv(q, k, v, cos, sin, kc, vc, slots, q_norm_weight=torch.ones(D + 2, device=DEVICE),
                      k_norm_weight=torch.ones(D, device=DEVICE))
    with pytest.raises(TypeError, match="cos must be"):
        rope_store_kv(q, k, v, cos.half(), sin, kc, vc, slots)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        rope_store_kv(q[:, :3], k, v, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="fold_k_scale needs"):
        rope_store_kv(q, k, v, cos, sin, kc, vc, slots, fold_k_scale=True)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        rope_store_kv(q, k, v, cos, sin, kc, vc, slots[:1])
