"""lora_bgmv: Punica's shrink/expand for a batch of mixed adapters, against a per-token loop (the
oracle) and the plain-PyTorch reference, on fresh random shapes: on a CPU under Triton's
interpreter, natively on a GPU. Rows with slot -1 must come out bit-for-bit untouched."""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels.lora_bgmv import add_lora, add_lora_ref, lora_expand, lora_shrink

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 or a CUDA GPU")


def make_case(seed, T, K, N, L, R, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype).to(device)
    a = (torch.randn(L, R, K, generator=g) / K**0.5).to(dtype).to(device)
    b = torch.randn(L, N, R, generator=g).to(dtype).to(device)
    slots = torch.randint(-1, L, (T,), generator=g)
    slots[0] = -1  # at least one untouched row, and (for T > 1) one adapted
    if T > 1:
        slots[1] = L - 1
    y = torch.randn(T, N + 5, generator=g).to(dtype).to(device)  # an output wider than the slice
    return x, a, b, slots.to(device), y


def per_token(y, x, a, b, slots, off, N):
    """The oracle: each token alone, in fp32."""
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            d = (x[t].double() @ a[s].double().T) @ b[s].double().T  # [N]
            out[t, off:off + N] = (y[t, off:off + N].double() + d).to(y.dtype)
    return out


SHAPES = [(1, 16, 24, 1, 4), (7, 48, 40, 3, 8), (13, 96, 130, 4, 16), (5, 33, 17, 2, 3)]


@needs_triton
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_add_lora_matches_per_token(seed, shape):
    T, K, N, L, R = shape
    x, a, b, slots, y = make_case(seed, T, K, N, L, R)
    want = per_token(y, x, a, b, slots, 2, N)
    got = y.clone()
    add_lora(got[:, 2:2 + N], x, a, b, slots)  # a strided column slice, as qkv_proj's parts are
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untouched = (slots < 0).cpu()
    assert torch.equal(got.cpu()[untouched], y.cpu()[untouched])  # no adapter: bit-for-bit as it was
    assert torch.equal(got.cpu()[:, :2], y.cpu()[:, :2]) and torch.equal(got.cpu()[:, 2 + N:], y.cpu()[:, 2 + N:])


@needs_triton
def test_shrink_then_expand_in_int32_slots():
    x, a, b, slots, y = make_case(11, 6, 32, 20, 2, 8)
    s = lora_shrink(x, a, slots.to(torch.int32))  # [T, R]
    adapted = slots >= 0
    ref = torch.einsum("tk,trk->tr", x.double(), a[slots.clamp(min=0)].double())
    torch.testing.assert_close(s[adapted].double(), ref[adapted], rtol=1e-4, atol=1e-4)
    got = y[:, :20].clone()
    lora_expand(got, s, b, slots.to(torch.int32))
    torch.testing.assert_close(got, per_token(y, x, a, b, slots, 0, 20)[:, :20], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_reference_matches_per_token(seed, shape):
    T, K, N, L, R = shape
    x, a, b, slots, y = make_case(seed + 100, T, K, N, L, R, device="cpu")
    got = y.clone()
    add_lora_ref(got[:, 1:1 + N], x, a, b, slots)
    torch.testing.assert_close(got, per_token(y, x, a, b, slots, 1, N), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    x, a, _, slots, _ = make_case(0, 4, 16, 8, 2, 4, device="cpu")
    with pytest.raises(ValueError, match="one slot per token"):
        lora_shrink(x, a, slots[:3])
    with pytest.raises(TypeError, match="slots must be a 1-D int32/int64"):
        lora_shrink(x, a, slots.float())
    with pytest.raises(ValueError, match="same inner size"):
        lora_shrink(x[:, :8].contiguous(), a, slots)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_lora_gpu_real_shapes(dtype):
    T, K, N, L, R = 256, 4096, 4096 + 2 * 1024, 8, 16
    x, a, b, slots, y = make_case(3, T, K, N, L, R, dtype=dtype)
    want = y.clone()
    add_lora_ref(want[:, 2:2 + N], x, a, b, slots)
    got = y.clone()
    add_lora(got[:, 2:2 + N], x, a, b, slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got[slots < 0], y[slots < 0])


def per_token_parts(y, x, a, b, slots, offsets):
    """The oracle for stacked parts: part i reads A rows i*R.., writes B's rows of its columns."""
    out, R, N = y.clone(), b.shape[2], y.shape[1]
    ends = [*offsets[1:], N]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for i, (lo, hi) in enumerate(zip(offsets, ends)):
                d = (x[t].double() @ a[s, i * R:(i + 1) * R].double().T) @ b[s, lo:hi].double().T
                out[t, lo:hi] = (y[t, lo:hi].double() + d).to(y.dtype)
    return out


@needs_triton
@pytest.mark.parametrize("offsets", [(0, 40, 56), (0, 37), (0, 5, 70)])  # q|k|v, gate|up, odd cuts
def test_stacked_parts_in_two_launches(offsets):
    T, K, N, L, R = 9, 48, 88, 3, 4
    x, _, b, slots, y = make_case(sum(offsets), T, K, N, L, R)
    g = torch.Generator().manual_seed(len(offsets))
    a = torch.randn(L, len(offsets) * R, K, generator=g).to(DEVICE) / K**0.5  # [L, S * R, K]
    want = per_token_parts(y[:, :N], x, a, b, slots, list(offsets))
    for add in (add_lora, add_lora_ref):
        got = y[:, :N].clone()
        add(got, x, a, b, slots, offsets)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="slice_offsets must be"):
        add_lora(y[:, :N].clone(), x, a, b, slots, (0, 100))
