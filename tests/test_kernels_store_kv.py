"""store_kv: the Triton kernel that writes new tokens' K and V into the paged cache, against its
PyTorch reference and a hand-written loop (the oracle), on fresh random inputs: on a CPU under
Triton's interpreter, on a GPU natively.

A copy does no arithmetic, so everything is held to bit-for-bit equality. Each cache is a slice of a
bigger buffer filled with a sentinel: a write to a padding slot (-1), past the end, to the wrong
row, head or lane leaves a trace somewhere the oracle does not, including the guard blocks around
the cache.
"""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels import store_kv as store_kv_module
from minillm.kernels.store_kv import store_kv, store_kv_ref
from minillm.layers.attention import store_kv as dispatched_store_kv
from minillm.layers.backend import kernel_mode

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
SENTINEL = 7.25  # exact in every float dtype


def make_case(seed: int, T: int, Hq: int, Hkv: int, D: int, num_blocks: int, block_size: int,
              dtype=torch.float32, index_dtype=torch.int64, num_pad: int = 2):
    """k, v as strided views of one fused qkv [T, (Hq + 2 Hkv) * D]; caches [num_blocks, block_size,
    Hkv, D] cut from a sentinel-filled buffer with a guard block on each side; slot_mapping: distinct
    random rows with num_pad of them replaced by -1."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)  # token stride (Hq + 2 Hkv) * D: not contiguous
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[:num_pad]] = -1
    bufs = [torch.full((num_blocks + 2, block_size, Hkv, D), SENTINEL, dtype=dtype, device=DEVICE)
            for _ in range(2)]
    return k, v, bufs, slots.to(index_dtype).to(DEVICE)


def oracle(k, v, k_cache, v_cache, slot_mapping) -> None:
    """One token at a time, as written on the blackboard."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def run(fn, k, v, bufs, slot_mapping):
    """fn on fresh copies of the guarded buffers; returns the whole buffers, guards included."""
    kb, vb = (b.clone() for b in bufs)
    fn(k, v, kb[1:-1], vb[1:-1], slot_mapping)  # the cache proper: contiguous, between the guards
    return kb, vb


CASES = [  # T, Hq, Hkv, D, num_blocks, block_size
    (6, 2, 1, 64, 8, 1),
    (9, 6, 2, 24, 2, 16),  # GQA, head_dim not a power of two (BLOCK_D 32, 8 lanes masked)
    (7, 3, 3, 80, 1, 32),
    (12, 8, 4, 16, 3, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("T, Hq, Hkv, D, num_blocks, block_size", CASES)
def test_kernel_and_reference_match_the_loop(seed, T, Hq, Hkv, D, num_blocks, block_size, dtype, index_dtype):
    k, v, bufs, slots = make_case(seed, T, Hq, Hkv, D, num_blocks, block_size, dtype, index_dtype)
    assert not k.is_contiguous() and (slots < 0).sum() == 2
    want_k, want_v = run(oracle, k, v, bufs, slots)
    for fn in (store_kv, store_kv_ref):
        got_k, got_v = run(fn, k, v, bufs, slots)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), fn.__name__
    # The oracle itself: the written rows hold k and v, every other row (and both guards) the sentinel.
    flat_k, flat_v = want_k.flatten(0, 1), want_v.flatten(0, 1)  # [(num_blocks + 2) * block_size, Hkv, D]
    written = slots[slots >= 0].long() + block_size  # + the guard block in front
    assert torch.equal(flat_k[written], k[slots >= 0]) and torch.equal(flat_v[written], v[slots >= 0])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert (flat_k[untouched] == SENTINEL).all() and (flat_v[untouched] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bit_pattern_is_copied_exactly(dtype):
    """All 65536 16-bit patterns, NaNs and infinities included, land in the cache unchanged (also
    under the interpreter, which has no native bfloat16)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).to(DEVICE)
    k = bits.view(dtype).view(64, 4, 256)
    v = k.flip(0)
    slots = torch.randperm(128, device="cpu")[:64].to(DEVICE)
    caches = [torch.zeros(8, 16, 4, 256, dtype=dtype, device=DEVICE) for _ in range(2)]
    store_kv(k, v, *caches, slots)
    flat = [c.view(-1, 4, 256)[slots] for c in caches]
    assert torch.equal(flat[0].view(torch.int16), k.view(torch.int16))
    assert torch.equal(flat[1].view(torch.int16), v.contiguous().view(torch.int16))


def test_all_padding_and_no_tokens_write_nothing(seed):
    k, v, bufs, slots = make_case(seed, 4, 2, 2, 32, 2, 4, num_pad=4)
    for n in (4, 0):  # every token padding; an empty batch
        got_k, got_v = run(store_kv, k[:n], v[:n], bufs, slots[:n])
        assert (got_k == SENTINEL).all() and (got_v == SENTINEL).all()


def test_kernel_drops_slots_past_the_cache(seed):
    """The caller's bug, but not a license to write past the cache (the reference raises instead, on a
    CPU; on a GPU index_copy_ trips a device-side assert, which would poison the CUDA context)."""
    k, v, bufs, slots = make_case(seed, 4, 2, 2, 32, 2, 4, num_pad=0)
    slots[1], slots[3] = 2 * 4, 2 * 4 + 5  # just past the end; into the guard block
    want = run(oracle, k[::2], v[::2], bufs, slots[::2])
    got = run(store_kv, k, v, bufs, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if DEVICE == "cpu":
        with pytest.raises(IndexError):
            run(store_kv_ref, k, v, bufs, slots)


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_dispatcher_matches_the_loop(seed, mode, monkeypatch):
    k, v, bufs, slots = make_case(seed, 5, 4, 2, 48, 3, 4)
    v = v.contiguous()  # k and v with different token strides, and k's heads 64 apart, not 48
    k = torch.cat([k, torch.zeros_like(k[..., :16])], dim=-1)[..., :48]
    calls = []
    kernel = store_kv_module.store_kv
    monkeypatch.setattr(store_kv_module, "store_kv", lambda *a: (calls.append(1), kernel(*a)))
    with kernel_mode(mode):
        got = run(dispatched_store_kv, k, v, bufs, slots)
    want = run(oracle, k, v, bufs, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(calls) == (mode == "triton")  # the kernel ran exactly when the mode asks for it


def _bad_inputs():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    s = torch.tensor([0, 5, -1])
    return [
        ((k[0], v[0], kc, vc, s), ValueError),  # k 2-D
        ((k, v[:, :1], kc, vc, s), ValueError),  # v's shape differs
        ((k, v, kc[0], vc[0], s), ValueError),  # caches 3-D
        ((k, v, kc[..., :4], vc[..., :4], s), ValueError),  # head_dim differs from k's
        ((k, v, kc, vc[:1], s), ValueError),  # caches of different shapes
        ((k, v, kc, vc, s[:2]), ValueError),  # slot_mapping not [T]
        ((k, v.half(), kc, vc, s), TypeError),  # dtypes differ
        ((k, v, kc, vc.half(), s), TypeError),
        ((k, v, kc, vc, s.float()), TypeError),  # float slot_mapping
        ((k, v, kc, vc, s.to(torch.int16)), TypeError),
        ((k.int(), v.int(), kc.int(), vc.int(), s), TypeError),  # not floats
        ((k, v, kc, vc, [0, 5, -1]), TypeError),  # not a tensor
    ]


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref])
def test_bad_input_is_refused(fn):
    for args, error in _bad_inputs():
        with pytest.raises(error):
            fn(*args)


def test_kernel_refuses_what_it_cannot_address():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc = torch.zeros(2, 4, 2, 8)
    s = torch.tensor([0, 5, -1])
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(k, v, torch.zeros(4, 4, 2, 8)[::2], torch.zeros(4, 4, 2, 8)[::2], s)  # every other block
    with pytest.raises(ValueError, match="last dim"):
        store_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, kc.clone(), s)  # D strided


@needs_cuda
def test_cuda_graph_replay_and_int64_offsets():
    """Captured once, replayed with new tokens and slots (no host sync inside), into a cache of more
    than 2^31 numbers, at rows whose offset only int64 can hold."""
    Hkv, D, block_size = 1, 128, 16
    num_blocks = 2**31 // (block_size * Hkv * D) + 2  # 2^31 + 2 * 2048 numbers: 4 GiB per fp16 cache
    caches = [torch.zeros(num_blocks, block_size, Hkv, D, dtype=torch.float16, device="cuda") for _ in range(2)]
    k, v = torch.zeros(4, Hkv, D, device="cuda", dtype=torch.float16), torch.zeros(4, Hkv, D, device="cuda",
                                                                                 dtype=torch.float16)
    slots = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    store_kv(k, v, *caches, slots)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, *caches, slots)
    last = num_blocks * block_size - 1
    k.copy_(torch.randn_like(k)), v.copy_(torch.randn_like(v))
    slots.copy_(torch.tensor([last, 3, -1, last - 20], device="cuda"))
    graph.replay()
    flat = [c.view(-1, Hkv, D) for c in caches]
    for t, s in ((0, last), (1, 3), (3, last - 20)):
        assert torch.equal(flat[0][s], k[t]) and torch.equal(flat[1][s], v[t])
    assert (flat[0][last - 1] == 0).all() and (flat[1][last - 19] == 0).all()
