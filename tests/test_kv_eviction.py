"""KV eviction (chapter 15, minillm/engine/kv_eviction.py): sliding-window layers free their blocks, and
StreamingLLM keeps sinks + recent blocks; each against an oracle that keeps every block."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minillm.bench.serving_setup import NoTextTokenizer
from minillm.cache.spec import KVCacheSpec
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.block_manager import BlockManager
from minillm.engine.kv_eviction import (
    NULL_BLOCK,
    SlidingWindow,
    StreamingLLM,
    compact_tables,
    make_kv_eviction,
)
from minillm.engine.prefix_cache import HashPrefixCache
from minillm.kernels import flash_attn, flash_decode
from minillm.kernels.rotary import apply_rotary_ref
from minillm.layers.rotary_embedding import RotaryEmbedding
from minillm.loader import load_model
from minillm.sampling import SamplingParams
from minillm.worker.kv_compaction import SinkRotation, reserved_sink_blocks

_MODELS: dict = {}
GPU = torch.cuda.is_available()


def kernel(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the GPU when there is one (the Triton kernels run natively there, interpreted
    on a CPU); -> its result on the CPU."""
    if not GPU:
        return fn(*args, **kwargs)

    def move(x):
        return x.cuda() if isinstance(x, torch.Tensor) else x
    return fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()}).cpu()


def tiny(windows: tuple, max_pos: int = 512):
    """A 2-layer random Llama-shaped model on the CPU, fp32, with these per-layer sliding windows."""
    if (windows, max_pos) not in _MODELS:
        cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=max_pos,
                          sliding_windows=list(windows), name="kv-eviction-random")
        model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(15)
        with torch.no_grad():
            for name, p in model.named_parameters():  # large weights: clear winners among the logits
                norm = "norm" in name
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        _MODELS[windows, max_pos] = model
    return _MODELS[windows, max_pos]


def run(model, prompts, max_tokens, **config):
    """Greedy outputs of every prompt, and the engine (for its block counts)."""
    engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(**config), progress=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                            ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return [got[f"r{i}"] for i in range(len(prompts))], engine


def prompts(rng, lengths):
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


# ---- 1. sliding windows ----------------------------------------------------------------------------

W, BS = 8, 4


@pytest.mark.parametrize("prefix", [None, "hash", "radix"])
def test_sliding_window_frees_blocks_same_tokens(prefix):
    """Window 8, blocks of 4, generations 6x the window: the same greedy tokens as the engine that keeps
    every block, and the pool never holds more than ceil(W / bs) + 2 blocks per sequence (chunks of 4)."""
    model = tiny((W, W))
    ps = prompts(random.Random(0), [5, 13, 2])
    ps.append(ps[1][:9] + [7, 7])  # shares two full blocks with prompt 1: a prefix hit
    common = dict(block_size=BS, num_gpu_blocks=200, max_num_batched_tokens=4, enable_prefix_caching=prefix)
    want, full = run(model, ps, 48, kv_eviction="none", **common)
    got, engine = run(model, ps, 48, **common)  # "auto": every layer has a window
    assert got == want
    assert engine.block_manager.eviction is not None
    named = 3 if prefix == "radix" else 0  # radix: a sequence's named blocks (at most 3 here) stay held
    assert engine.block_manager.peak_used <= len(ps) * (-(-W // BS) + 2 + named) < full.block_manager.peak_used


def test_sliding_window_under_preemption():
    """A pool too small for the three sequences at once: recompute preemption, same tokens."""
    model = tiny((W, W))
    ps = prompts(random.Random(1), [6, 11, 3])
    want, _ = run(model, ps, 40, kv_eviction="none", block_size=BS, num_gpu_blocks=200)
    got, engine = run(model, ps, 40, block_size=BS, num_gpu_blocks=9, max_num_batched_tokens=4,
                      preemption_mode="swap", num_cpu_blocks=64)  # swap: refused once evicted, so recompute
    assert got == want
    assert engine.scheduler.num_preemptions > 0


def test_long_request_fits_a_small_pool():
    """A request 10x longer than the pool completes: it only ever holds its window."""
    model = tiny((W, W))
    ps = prompts(random.Random(2), [4])
    want, _ = run(model, ps, 120, kv_eviction="none", block_size=BS, num_gpu_blocks=64)
    got, engine = run(model, ps, 120, block_size=BS, num_gpu_blocks=6, max_num_batched_tokens=4)
    assert got == want and engine.block_manager.peak_used <= -(-W // BS) + 2


def test_mixed_model_keeps_every_block():
    """One full-attention layer reads every block: "auto" evicts nothing, "sliding" is refused."""
    model = tiny((W, None))
    ps = prompts(random.Random(3), [5])
    _, engine = run(model, ps, 30, block_size=BS, num_gpu_blocks=64)
    assert engine.block_manager.eviction is None
    with pytest.raises(ValueError, match="kv_eviction='sliding'"):
        make_kv_eviction(EngineConfig(kv_eviction="sliding"), model.config)
    with pytest.raises(ValueError, match="kv_eviction='streaming'"):
        make_kv_eviction(EngineConfig(kv_eviction="streaming", kv_budget=64), tiny((W, W)).config)


def test_bad_configs():
    for bad, field in [(dict(kv_eviction="lru"), "kv_eviction"), (dict(kv_eviction="streaming"), "kv_budget"),
                       (dict(kv_eviction="streaming", kv_budget=16, block_size=16), "kv_budget"),
                       (dict(kv_eviction="streaming", kv_budget=15, sink_tokens=0, block_size=16), "kv_budget"),
                       (dict(kv_budget=64), "kv_budget"), (dict(sink_tokens=-1), "sink_tokens")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)


def test_block_manager_sliding_bookkeeping():
    """Entries before the window point at block 0, which is never handed out; freed ones are reused;
    a sequence with evicted entries names no more blocks, and a hit keeps only the window's blocks."""
    cache = HashPrefixCache(BS)
    bm = BlockManager(12, BS, prefix_cache=cache, eviction=SlidingWindow(W, BS, 4))
    tokens = list(range(40))
    for n in range(1, 30):
        assert bm.allocate_slots(1, n, 1)
        bm.cache_full_blocks(1, tokens, n)  # (the engine names blocks as they fill)
    table = bm.block_tables[1]
    # the query at position 28 sees keys >= 21: blocks 0..4 (positions < 20) are gone
    assert table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in table[5:]
    assert bm.num_used_blocks == 3 and bm.ref_counts[NULL_BLOCK] == 0
    # blocks 0 and 1 were named before eviction began (at position 11), none after
    assert len(bm.match_prefix(tokens[:30])) == 2
    bm.free(1)
    assert bm.num_used_blocks == 0 and NULL_BLOCK not in bm.free_blocks
    assert bm.allocate_slots(3, 20, 20)  # one chunk: nothing is evicted before it, all 5 blocks named
    bm.cache_full_blocks(3, tokens, 20)
    hits = bm.match_prefix(tokens[:30])
    assert len(hits) == 5
    assert bm.allocate_slots(2, 30, 10, hits)  # computed 20: its window starts at 13, in block 3
    assert bm.block_tables[2][:3] == [NULL_BLOCK] * 3 and bm.block_tables[2][3:5] == hits[3:5]
    assert all(bm.ref_counts[b] == 2 for b in hits[3:])  # seq 3 and seq 2; hits[:3] not taken
    bm.free(2)
    bm.free(3)
    assert bm.num_used_blocks == 0 and NULL_BLOCK not in bm.free_blocks


# ---- the kernels read nothing from a null entry ----------------------------------------------------

@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_null_entries_before_the_window_change_nothing(decode, triton):
    """The attention the layers run (the torch references on a CPU, the Triton kernels, here interpreted)
    with entries before the window pointed at block 0 (zeros, never written) equals the same attention
    over the full table, exactly. flash_decode never loads a key before the window; flash_attn's left-edge
    tile does (it rounds down to a tile) and the torch reference gathers every key: the window masks their
    scores, and a masked score times block 0's zero value adds exactly 0."""
    g = torch.Generator().manual_seed(0)
    bs, Hq, Hkv, D, L = 4, 4, 2, 16, 23
    nblk = -(-L // bs)
    k_cache = torch.randn(2 + nblk, bs, Hkv, D, generator=g)
    v_cache = torch.randn(2 + nblk, bs, Hkv, D, generator=g)
    k_cache[0], v_cache[0] = 0, 0
    full = torch.arange(1, nblk + 1, dtype=torch.int32)[None]
    nq = 1 if decode else 3
    lo, hi = SlidingWindow(W, bs, nq).evictable(L - nq)
    evicted = full.clone()
    evicted[0, lo:hi] = NULL_BLOCK
    assert hi > 1
    q = torch.randn(nq, Hq, D, generator=g)
    seq_lens = torch.tensor([L], dtype=torch.int32)
    if decode:
        fn = flash_decode.flash_decode if triton else flash_decode.flash_decode_ref

        def attend(t):
            return kernel(fn, q, k_cache, v_cache, seq_lens, t, sliding_window=W)
    else:
        cu = torch.tensor([0, nq], dtype=torch.int32)
        fn = flash_attn.flash_attn_varlen if triton else flash_attn.flash_attn_varlen_ref

        def attend(t):
            return kernel(fn, q, k_cache, v_cache, cu, nq, seqused_k=seq_lens, block_table=t, sliding_window=W)
    torch.testing.assert_close(attend(evicted), attend(full), rtol=0, atol=0)


# ---- 2. StreamingLLM -------------------------------------------------------------------------------

def paged_evicted(k, v, pol, start: int, g, extra_blocks: int = 0):
    """K/V [L, Hkv, D] written to a randomly permuted paged pool (block 0 and extra_blocks at the end
    left empty), and the sequence's table with the entries pol evicts before `start` nulled."""
    L, bs = k.shape[0], pol.block_size
    nblk = -(-L // bs)
    blocks = torch.randperm(nblk, generator=g) + 1  # logical block i lives in pool block blocks[i]
    k_cache, v_cache = (torch.zeros(nblk + 1 + extra_blocks, bs, *k.shape[1:]) for _ in range(2))
    for p in range(L):
        k_cache[blocks[p // bs], p % bs], v_cache[blocks[p // bs], p % bs] = k[p], v[p]
    lo, hi = pol.evictable(start)
    return k_cache, v_cache, [NULL_BLOCK if lo <= i < hi else int(b) for i, b in enumerate(blocks)]


def test_compact_tables():
    table = np.array([[3, 0, 0, 7, 8, 0], [5, 6, 0, 0, 0, 0]], dtype=np.int32)
    out, lens, evicted, entries = compact_tables(table, [18, 7], 4)  # row 0: 5 entries in use, 2 of them null
    assert out.tolist() == [[3, 7, 8, 0, 0, 0], [5, 6, 0, 0, 0, 0]] and lens == [10, 7] and evicted == [8, 0]
    assert entries[0, :3].tolist() == [0, 3, 4] and entries[1, :2].tolist() == [0, 1]


def dense_sink_window(q, k, v, q_pos, kept):
    """Plain attention of queries at q_pos over exactly the keys at positions `kept` (fp32)."""
    group = q.shape[1] // k.shape[1]
    k, v = k[kept].repeat_interleave(group, 1), v[kept].repeat_interleave(group, 1)  # [K, Hq, D]
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.tensor(kept)[None, None, :] > torch.tensor(q_pos)[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("nq", [1, 5])
def test_streaming_attention_matches_dense_reference(nq, triton):
    """Random K/V in a paged cache, the middle blocks evicted: the compacted table through the engine's
    attention (the decode and prefill references) equals dense attention over sinks + recent keys."""
    g = torch.Generator().manual_seed(nq)
    bs, Hq, Hkv, D, L = 4, 4, 2, 16, 41
    pol = StreamingLLM(sink_tokens=4, kv_budget=16, block_size=bs, max_chunk=8)
    k = torch.randn(L, Hkv, D, generator=g)
    v = torch.randn(L, Hkv, D, generator=g)
    k_cache, v_cache, table = paged_evicted(k, v, pol, L - nq, g)
    start = L - nq
    t, lens, *_ = compact_tables([table], [L], bs)
    t, lens = torch.as_tensor(t), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(nq, Hq, D, generator=g)
    out = attend_paged(triton, q, k_cache, v_cache, lens, t)
    kept = pol.kept(start, L)
    assert len(kept) < L and kept[:4] == [0, 1, 2, 3]
    torch.testing.assert_close(out, dense_sink_window(q, k, v, list(range(start, L)), kept), rtol=1e-4, atol=1e-5)


def attend_paged(triton: bool, q, k_cache, v_cache, seq_lens, table):
    """One sequence's queries q [nq, Hq, D] (the last nq of its seq_lens[0] keys) through the engine's
    attention: the decode kernel for one query, the prefill kernel for more (or their torch references)."""
    nq = q.shape[0]
    if nq == 1:
        return kernel(flash_decode.flash_decode if triton else flash_decode.flash_decode_ref,
                      q, k_cache, v_cache, seq_lens, table)
    return kernel(flash_attn.flash_attn_varlen if triton else flash_attn.flash_attn_varlen_ref, q, k_cache, v_cache,
                  torch.tensor([0, nq], dtype=torch.int32), nq, seqused_k=seq_lens, block_table=table)


def streaming_reference(model, prompt, n, pol):
    """Greedy decoding with plain PyTorch attention and no cache: the whole sequence recomputed at every
    step, query p (a decode, p >= len(prompt)) allowed the keys pol.kept(p, p + 1), the prompt's queries
    everything before them (it is one prefill chunk)."""
    from minillm.layers.attention import AttentionMetadata

    ids = list(prompt)
    for _ in range(n):
        L = len(ids)
        mask = torch.zeros(L + 1, L + 1, dtype=torch.bool)  # + a 1-token dummy sequence: the masked path
        for p in range(L):
            keys = range(p + 1) if p < len(prompt) else pol.kept(p, p + 1)
            mask[p, list(keys)] = True
        mask[L, L] = True
        meta = AttentionMetadata.from_seq_lens([L, 1])
        meta._masks[None] = mask
        pos = torch.tensor(list(range(L)) + [0])
        with torch.no_grad():
            hidden = model(torch.tensor(ids + [0]), pos, meta)
            ids.append(int(model.compute_logits(hidden[L - 1:L]).argmax(-1)))
    return ids[len(prompt):]


def test_streaming_engine_matches_reference():
    """The engine under StreamingLLM (sinks 4, budget 16 tokens, blocks of 4) generates what plain masked
    attention over the same kept tokens generates, batched as alone, and differs from the full cache."""
    model = tiny((None, None))
    ps = prompts(random.Random(4), [6, 3])
    pol = StreamingLLM(4, 16, BS, 64)
    cfg = dict(block_size=BS, num_gpu_blocks=64, kv_eviction="streaming", sink_tokens=4, kv_budget=16)
    got, engine = run(model, ps, 30, **cfg)
    assert got == [streaming_reference(model, p, 30, pol) for p in ps]
    assert got[0] == run(model, ps[:1], 30, **cfg)[0][0]
    assert engine.block_manager.peak_used <= 2 * 4
    full, _ = run(model, ps, 30, block_size=BS, num_gpu_blocks=64)
    assert full != got


def test_streaming_with_prefix_caching_is_streaming_without():
    """Prompts of one chunk name their blocks, then StreamingLLM evicts some of them: with either prefix
    cache the tokens are those without one. (The radix tree keeps named blocks held until the sequence
    ends; they must still leave the table, or the compacted attention would read them.)"""
    model = tiny((None, None))
    ps = prompts(random.Random(7), [30, 5, 22])
    cfg = dict(block_size=BS, num_gpu_blocks=64, kv_eviction="streaming", sink_tokens=4, kv_budget=16)
    want, _ = run(model, ps, 20, **cfg)
    for prefix in ("hash", "radix"):
        got, engine = run(model, ps, 20, enable_prefix_caching=prefix, **cfg)
        bm = engine.block_manager
        assert got == want, prefix
        assert sum(bm.ref_counts) == 0 and bm.num_free_blocks == bm.num_blocks - 1


@pytest.mark.slow
def test_streaming_unbounded_generation_constant_memory():
    """A request 40x the pool's tokens completes, holding kv_budget tokens all along."""
    model = tiny((None, None), max_pos=2048)
    got, engine = run(model, prompts(random.Random(5), [5]), 1000, block_size=BS, num_gpu_blocks=6,
                      kv_eviction="streaming", sink_tokens=4, kv_budget=16, max_num_batched_tokens=4)
    assert len(got[0]) == 1000 and engine.block_manager.peak_used <= 5


# ---- 2b. StreamingLLM positions: the original ones, or places within the cache (kv_positions) ------

def rope_attention_reference(q0, k0, v, q_pos, k_pos, kept_len):
    """Plain attention with RoPE applied here: pre-RoPE queries q0 [nq, Hq, D] at positions q_pos and
    keys k0 / values v [K, Hkv, D] at k_pos; query i sees keys 0 .. kept_len - nq + i (in list order)."""
    rope = RotaryEmbedding(q0.shape[-1], 256, 10000.0)
    q = apply_rotary_ref(q0, q0, *rope.cos_sin(torch.tensor(q_pos), torch.float32))[0]
    k = apply_rotary_ref(k0, k0, *rope.cos_sin(torch.tensor(k_pos), torch.float32))[1]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [K, Hq, D]
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5  # [Hq, nq, K]
    last = kept_len - len(q_pos) + torch.arange(len(q_pos))  # [nq] each query's own index among the keys
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > last[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("nq", [1, 5])
def test_streaming_positions_attention_matches_reference(positions, triton, nq):
    """Pre-RoPE K/V of 41 positions; the engine's path: keys rotated at their own positions into a paged
    pool, the middle blocks evicted, the table compacted and (kv_positions='cache') the sinks' rotated
    copies made by SinkRotation, through the attention kernels, equals plain attention over the kept
    tokens with RoPE at their original positions, or at their places 0, 1, 2, ... among the kept tokens
    (the paper's). The two references differ: the test tells the modes apart."""
    g = torch.Generator().manual_seed(nq + 7)
    bs, Hq, Hkv, D, L, rows = 4, 4, 2, 16, 41, 3
    pol = StreamingLLM(sink_tokens=6, kv_budget=20, block_size=bs, max_chunk=8)  # 2 sink blocks, 3 recent
    nblk = -(-L // bs)
    q0, k0, v = (torch.randn(n, h, D, generator=g) for n, h in ((nq, Hq), (L, Hkv), (L, Hkv)))
    rope = RotaryEmbedding(D, 256, 10000.0)
    k = apply_rotary_ref(k0, k0, *rope.cos_sin(torch.arange(L), torch.float32))[1]  # as the model writes them
    q = apply_rotary_ref(q0, q0, *rope.cos_sin(torch.arange(L - nq, L), torch.float32))[0]
    start = L - nq
    k_cache, v_cache, table = paged_evicted(k, v, pol, start, g, reserved_sink_blocks(pol.sink_blocks, rows))
    lo, hi = pol.evictable(start)
    t, lens, evicted, _ = compact_tables([table], [L], bs)
    assert evicted[0] == (hi - lo) * bs > 0
    if positions == "cache":  # our sequence in batch row 2 of 3: its copies go to that row's blocks
        cache = SimpleNamespace(k_caches=[k_cache], v_caches=[v_cache], num_blocks=k_cache.shape[0],
                                specs=[KVCacheSpec(Hkv, D, torch.float32)])
        rot = SinkRotation(torch.nn.Sequential(rope), cache, pol.sink_blocks, rows)
        t3 = rot.apply(np.concatenate([t, t, t]), [0, 0, evicted[0]])
        assert (t3[:2] == t).all() and t3[2, :2].tolist() == [nblk + 1 + 4, nblk + 1 + 5]
        t = t3[2:]
        assert torch.equal(k_cache[table[0]], k[:bs])  # the originals stay as written (shared)
    t, lens = torch.as_tensor(t), torch.tensor(lens, dtype=torch.int32)
    out = attend_paged(triton, q, k_cache, v_cache, lens, t)
    kept = pol.kept(start, L)
    by_original = rope_attention_reference(q0, k0[kept], v[kept], list(range(start, L)), kept, len(kept))
    in_cache = list(range(len(kept)))
    by_cache = rope_attention_reference(q0, k0[kept], v[kept], in_cache[-nq:], in_cache, len(kept))
    assert (by_original - by_cache).abs().max() > 1e-2
    torch.testing.assert_close(out, by_original if positions == "original" else by_cache, rtol=1e-4, atol=1e-5)


def test_streaming_cache_positions_engine():
    """kv_positions='cache' through the engine: batched = alone; with no sinks it is the original
    positions exactly (only the sinks move); with sinks it is not; the rotated copies' blocks are never
    handed out. Bad values are refused, naming the field."""
    model = tiny((None, None))
    ps = prompts(random.Random(6), [6, 3, 9])
    cfg = dict(block_size=BS, num_gpu_blocks=64, kv_eviction="streaming", kv_budget=16, max_num_seqs=4)
    got, engine = run(model, ps, 30, sink_tokens=4, kv_positions="cache", **cfg)
    assert engine.block_manager.num_blocks == 64 - 4  # one sink block x max_num_seqs kept by the worker
    assert got[1] == run(model, ps[1:2], 30, sink_tokens=4, kv_positions="cache", **cfg)[0][0]
    assert got != run(model, ps, 30, sink_tokens=4, **cfg)[0]
    no_sinks = dict(cfg, sink_tokens=0)
    assert run(model, ps, 30, kv_positions="cache", **no_sinks)[0] == run(model, ps, 30, **no_sinks)[0]
    for bad, match in [(dict(kv_positions="cache"), "kv_positions='cache' is for kv_eviction='streaming'"),
                       (dict(kv_positions="rope"), "kv_positions")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="num_gpu_blocks=5"):
        run(model, ps, 2, **dict(cfg, num_gpu_blocks=5, sink_tokens=4, kv_positions="cache"))
