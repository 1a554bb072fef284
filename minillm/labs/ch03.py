"""Checks for lab 03: appending to the KV cache, a decode step's inputs, and attention over the cache."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from ..generation import prepare_inputs
from ..kernels.flash_decode import flash_decode_ref
from ..layers.attention import store_kv
from .checker import check
from .hints import Hints


def _tensors_equal(got, want) -> bool:
    if not (isinstance(got, tuple) and len(got) == len(want)):
        return False
    return all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g.cpu(), w.cpu())
               for g, w in zip(got, want))


def _cache_case(rng: random.Random):
    slots, max_len, Hkv, D = rng.randint(1, 4), rng.randint(4, 20), rng.choice([1, 2, 3]), rng.choice([4, 8])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return g, slots, max_len, Hkv, D


def check_append_kv(fn, cases: int = 50):
    """fn(k_cache, v_cache, k, v, slot_mapping) writes each new token's K and V (k, v: [T, Hkv, D])
    into its flat cache row (caches: [num_slots, max_len, Hkv, D], slot_mapping: [T]) in place."""

    def case(rng: random.Random):
        g, slots, max_len, Hkv, D = _cache_case(rng)
        T = rng.randint(1, slots * max_len)
        rows = torch.randperm(slots * max_len, generator=g)[:T]  # distinct rows, any order
        caches = [torch.randn(slots, max_len, Hkv, D, generator=g) for _ in range(2)]
        return caches[0], caches[1], torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g), rows

    def run_on_copies(f):
        def wrapped(k_cache, v_cache, k, v, slot_mapping):
            kc, vc = k_cache.clone(), v_cache.clone()  # both sides start from the same cache
            f(kc, vc, k, v, slot_mapping)
            return kc, vc
        return wrapped

    def reference(k_cache, v_cache, k, v, slot_mapping):
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    return check("append_kv", run_on_copies(fn), run_on_copies(reference), case, cases=cases, equal=_tensors_equal)


def check_decode_inputs(fn, cases: int = 100):
    """fn(seq_lens, slots, max_len) -> (positions [B], slot_mapping [B], seq_lens [B]) int64 tensors
    for a decode step: sequence b (now seq_lens[b] tokens long, in cache slot slots[b]) brings its
    last token, whose K/V are not cached yet."""

    def case(rng: random.Random):
        max_len = rng.randint(2, 64)
        B = rng.randint(1, 8)
        slots = rng.sample(range(16), B)
        return [rng.randint(1, max_len) for _ in range(B)], slots, max_len

    def reference(seq_lens, slots, max_len):
        cache = SimpleNamespace(slot_mapping=lambda s, a, b: list(range(s * max_len + a, s * max_len + b)))
        seqs = [SimpleNamespace(token_ids=[0] * n) for n in seq_lens]
        _, positions, meta = prepare_inputs(seqs, slots, [n - 1 for n in seq_lens], cache, "cpu")
        return positions, meta.slot_mapping, meta.seq_lens.long()

    def as_int64(f):
        def wrapped(*args):
            out = f(*args)
            return tuple(torch.as_tensor(t).long() for t in out) if isinstance(out, tuple) else out
        return wrapped

    return check("decode_inputs", as_int64(fn), reference, case, cases=cases, equal=_tensors_equal)


def check_cached_decode_attention(fn, cases: int = 50):
    """fn(q, k_cache, v_cache, slots, seq_lens) -> [B, Hq, D]: each sequence's one new query
    (q: [B, Hq, D]) attends over the seq_lens[b] keys cached in slot slots[b] (its own included)."""

    def case(rng: random.Random):
        g, num_slots, max_len, Hkv, D = _cache_case(rng)
        B = rng.randint(1, num_slots)
        Hq = Hkv * rng.choice([1, 2, 3])
        slots = torch.tensor(rng.sample(range(num_slots), B))
        seq_lens = torch.tensor([rng.randint(1, max_len) for _ in range(B)])
        kc, vc = (torch.randn(num_slots, max_len, Hkv, D, generator=g) for _ in range(2))
        return torch.randn(B, Hq, D, generator=g), kc, vc, slots, seq_lens

    def reference(q, k_cache, v_cache, slots, seq_lens):
        return flash_decode_ref(q, k_cache, v_cache, seq_lens.int(), slots.int()[:, None])

    def close(got, want):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-5)

    return check("cached_decode_attention", fn, reference, case, cases=cases, equal=close)


hint = Hints("03", {
    "append_kv": (
        "The cache's first two dims (slot, position) together number the rows a token can go to.",
        'View the cache as [num_slots * max_len, Hkv, D]; slot_mapping holds row indices into that view. Assigning through an indexed view writes into the cache in place.',
        'k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k\nv_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v',
    ),
    "decode_inputs": (
        'The new token of a sequence of length n sits at position n - 1.',
        'Its K/V row in the flat cache is slot * max_len + (n - 1); seq_lens stay as given (the new token counts).',
        'positions = [n - 1 for n in seq_lens]\nslot_mapping = [s * max_len + n - 1 for s, n in zip(slots, seq_lens)]',
    ),
    "cached_decode_attention": (
        "One query per sequence attends over that sequence's cached keys: loop over sequences.",
        'For sequence b read k_cache[slot, :n] and v_cache[slot, :n], repeat the KV heads for GQA, then softmax(q·Kᵀ/√D)·V; no causal mask is needed (every cached key is in the past).',
        "k = k_cache[s, :n].repeat_interleave(group, 1)\nscores = torch.einsum('hd,nhd->hn', q[b], k) / D**0.5\nout[b] = torch.einsum('hn,nhd->hd', scores.softmax(-1), v)",
    ),
})
