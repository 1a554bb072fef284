"""H2O and SnapKV (chapter 15, engine/kv_eviction.py, kernels/attn_mass.py): eviction by attention
mass, block by block, against plain-PyTorch references on random inputs."""

from __future__ import annotations

import random

import pytest
import torch
from test_kv_eviction import attend_paged, kernel, prompts, run, tiny

from minillm.engine import EngineConfig
from minillm.engine.block_manager import BlockManager
from minillm.engine.kv_eviction import H2O, NULL_BLOCK, SnapKV
from minillm.kernels.attn_mass import attention_mass, attention_mass_ref
from minillm.worker.kv_compaction import block_masses, compact_tables, observed_queries
from minillm.worker.model_input import ModelInput


@pytest.mark.parametrize("triton", [False, True])
def test_attention_mass_matches_dense_softmax(triton):
    """Three sequences in one step (a 3-token chunk, two decodes; GQA 3:1; a randomly permuted pool):
    the mass each key gets equals the plain softmax probabilities summed over queries and heads, added
    to what was there; every query hands out exactly one unit per head."""
    g = torch.Generator().manual_seed(1)
    bs, Hq, Hkv, D, N = 4, 6, 2, 8, 14
    lens, nq = [9, 1, 14], [3, 1, 1]
    cu = torch.tensor([0, 3, 4, 5], dtype=torch.int32)
    k_cache = torch.randn(N, bs, Hkv, D, generator=g)
    table = (torch.randperm(N - 1, generator=g)[:12] + 1).reshape(3, 4).int()
    q = torch.randn(5, Hq, D, generator=g)
    before = torch.rand(3, 16, generator=g)
    fn = attention_mass if triton else attention_mass_ref
    got = kernel(fn, before.clone(), q, k_cache, table, torch.tensor(lens, dtype=torch.int32), cu, 0.35)
    want = before.clone()
    for b in range(3):  # dense: keys gathered by position, query i of n sees keys <= L - n + i
        k = torch.cat([k_cache[int(table[b, j // bs]), j % bs][None] for j in range(lens[b])])  # [L, Hkv, D]
        for i in range(nq[b]):
            t = int(cu[b]) + i
            s = torch.einsum("hd,khd->hk", q[t], k.repeat_interleave(Hq // Hkv, 1)) * 0.35  # [Hq, L]
            s[:, lens[b] - nq[b] + i + 1:] = float("-inf")
            want[b, : lens[b]] += s.softmax(-1).sum(0)
    torch.testing.assert_close(got, want)
    assert torch.allclose((got - before).sum(1), torch.tensor(nq, dtype=torch.float32) * Hq)


def test_h2o_victims_are_the_lightest_outside_the_recent_window():
    pol = H2O(kv_budget=16, block_size=4, max_chunk=4)  # 4 blocks: 2 recent (the current among them)
    table = [5, 6, 7, 8, 9, 10]
    pol.observe(1, [0, 1, 2, 3, 4, 5], [3.0, 0.5, 0.5, 2.0, 0.1, 0.0])
    # step at 23 (block 5): full blocks 0-4 held, 5 + 1 > 4 -> 2 go; block 4 is recent; ties: the older
    assert pol.victims(1, table, 23, None) == [1, 2]
    assert pol.victims(1, [5, 0, 0, 8, 9, 10], 23, 3) == []
    assert pol.max_blocks(1000) == 4 + 1 and pol.max_blocks(9) == 3
    with pytest.raises(ValueError, match="kv_budget=7"):
        H2O(kv_budget=7, block_size=4, max_chunk=4)


def dense_h2o(q, k, v, prompt_len: int, budget_blocks: int, bs: int):
    """Plain-PyTorch H2O for one head group over a stream of tokens: the prompt in one step, then one
    token a step; before each decode step the lightest full blocks (outside the newest budget // 2)
    go while more than budget_blocks - 1 full blocks precede the step's block. -> every step's output."""
    L, Hq = k.shape[0], q.shape[1]
    group = Hq // k.shape[1]
    kept = torch.ones(L, dtype=torch.bool)
    mass = torch.zeros(L)
    recent = max(1, budget_blocks // 2)
    outs = []
    steps = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, L)]
    for start, end in steps:
        cur = start // bs
        full = [blk for blk in range(cur) if kept[blk * bs]]
        while len(full) + 1 > budget_blocks:
            blk = min(full[: len(full) - (recent - 1)], key=lambda c: (mass[c * bs:(c + 1) * bs].sum().item(), c))
            kept[blk * bs:(blk + 1) * bs] = False
            full.remove(blk)
        keys = torch.nonzero(kept[:end]).flatten()  # [K] positions still cached, in order
        kk, vv = k[keys].repeat_interleave(group, 1), v[keys].repeat_interleave(group, 1)  # [K, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[start:end], kk) * q.shape[-1] ** -0.5
        s = s.masked_fill(keys[None, None, :] > torch.arange(start, end)[None, :, None], float("-inf"))
        p = s.softmax(-1)  # [Hq, n, K]
        mass[keys] += p.sum((0, 1))
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
    return outs


@pytest.mark.parametrize("triton", [False, True])
def test_h2o_paged_equals_dense_reference(triton):
    """Random Q/K/V streams (prompt 10, 22 decode steps): the block manager under H2O, the paged pool,
    the compacted table, the attention kernel and the mass kernel give, step by step, the outputs of a
    dense H2O over exactly the kept tokens; the pool never holds more than the budget + the step."""
    g = torch.Generator().manual_seed(43)
    bs, Hq, Hkv, D, L, P, budget = 4, 4, 2, 16, 32, 10, 16
    q, k, v = (torch.randn(L, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    want = dense_h2o(q, k, v, P, budget // bs, bs)
    pol = H2O(budget, bs, max_chunk=P)
    bm = BlockManager(40, bs, eviction=pol)
    k_cache, v_cache = torch.zeros(40, bs, Hkv, D), torch.zeros(40, bs, Hkv, D)
    steps = [(0, P)] + [(p, p + 1) for p in range(P, L)]
    evicted_any = False
    for (start, end), out_want in zip(steps, want):
        assert bm.allocate_slots(7, end, end - start)
        table = bm.block_tables[7]
        evicted_any |= NULL_BLOCK in table
        assert sum(b != NULL_BLOCK for b in table) <= pol.max_blocks(end)
        for p in range(start, end):  # the step's K/V written to their slots
            k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k[p], v[p]
        c = compact_tables([table + [NULL_BLOCK] * (10 - len(table))], [end], bs)
        t, lens = torch.as_tensor(c.table), torch.tensor(c.seq_lens, dtype=torch.int32)
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        out = attend_paged(triton, q[start:end], k_cache, v_cache, lens, t)
        torch.testing.assert_close(out, out_want, rtol=1e-4, atol=1e-5)
        mass = kernel(attention_mass if triton else attention_mass_ref, torch.zeros(1, t.shape[1] * bs), q[start:end],
                      k_cache, t, lens, cu, D ** -0.5)
        bm.observe_attention(block_masses(mass, c, [7], bs))
    assert evicted_any
    bm.free(7)
    assert bm.num_used_blocks == 0 and 7 not in pol.mass


@pytest.mark.slow
def test_h2o_engine():
    """Through the engine: batched = alone; a budget no request reaches = the full cache exactly;
    a small one evicts (the pool stays within the budget) and differs from StreamingLLM's choice."""
    model = tiny((None, None))
    ps = prompts(random.Random(8), [6, 3, 9])
    cfg = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)
    got, engine = run(model, ps, 30, kv_eviction="h2o", kv_budget=16, **cfg)
    assert got[2] == run(model, ps[2:], 30, kv_eviction="h2o", kv_budget=16, **cfg)[0][0]
    assert engine.block_manager.peak_used <= 3 * engine.block_manager.eviction.max_blocks(40)
    full, _ = run(model, ps, 30, kv_eviction="none", **cfg)
    assert run(model, ps, 30, kv_eviction="h2o", kv_budget=64, **cfg)[0] == full != got
    assert got != run(model, ps, 30, kv_eviction="streaming", kv_budget=16, sink_tokens=4, **cfg)[0]


def test_h2o_bad_configs():
    for bad, match in [(dict(kv_eviction="h2o"), "kv_budget"), (dict(kv_eviction="h2o", kv_budget=4), "kv_budget=4"),
                       (dict(kv_eviction="h2o", kv_budget=64, enable_prefix_caching="hash"), "enable_prefix_caching"),
                       (dict(kv_eviction="h2o", kv_budget=64, async_scheduling=True), "async_scheduling"),
                       (dict(kv_eviction="h2o", kv_budget=64, kv_cache_dtype="int8"), "kv_cache_dtype"),
                       (dict(kv_eviction="h2o", kv_budget=64, kv_positions="cache"), "kv_positions"),
                       (dict(kv_eviction="snapkv", kv_budget=64, snapkv_window=0), "snapkv_window"),
                       (dict(kv_eviction="snapkv", kv_budget=64, async_scheduling=True), "async_scheduling")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_cli_and_llm_take_the_kv_eviction_settings():
    """`minillm serve` / `generate` flags reach EngineConfig; a bad value fails there, naming the field;
    LLM(...) passes them through."""
    from minillm.cli import build_parser
    from minillm.entrypoints.openai.cli_args import engine_kwargs, kv_eviction_kwargs
    from minillm.llm import LLM

    args = build_parser().parse_args(["serve", "--kv-eviction", "h2o", "--kv-budget", "64"])
    assert engine_kwargs(args) == {"kv_eviction": "h2o", "kv_budget": 64}
    gen = build_parser().parse_args(["generate", "hi", "--kv-eviction", "streaming", "--kv-budget", "32",
                                     "--sink-tokens", "4", "--kv-positions", "cache"])
    assert kv_eviction_kwargs(gen) == dict(kv_eviction="streaming", kv_budget=32, sink_tokens=4, kv_positions="cache")
    assert kv_eviction_kwargs(build_parser().parse_args(["generate", "hi"])) == {}
    with pytest.raises(ValueError, match="kv_eviction must be one of"):
        EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", "--kv-eviction", "lru"])))
    with pytest.raises(ValueError, match="kv_budget=8 must hold at least 2 blocks"):  # before any model loads
        LLM(kv_eviction="h2o", kv_budget=8)


# ---- SnapKV ------------------------------------------------------------------------------------------

def dense_snapkv(q, k, v, prompt_len: int, budget_blocks: int, window: int, bs: int):
    """Plain-PyTorch SnapKV: the prompt in one step; the softmax of its last `window` queries, summed over
    them and the heads, per block of keys; before the first decode the lightest full blocks before the
    window's first block go until budget_blocks remain with the step's; then nothing more goes."""
    L, Hq = k.shape[0], q.shape[1]
    group = Hq // k.shape[1]
    kept = torch.ones(L, dtype=torch.bool)
    outs = []
    for start, end in [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, L)]:
        keys = torch.nonzero(kept[:end]).flatten()
        kk, vv = k[keys].repeat_interleave(group, 1), v[keys].repeat_interleave(group, 1)  # [K, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[start:end], kk) * q.shape[-1] ** -0.5
        s = s.masked_fill(keys[None, None, :] > torch.arange(start, end)[None, :, None], float("-inf"))
        p = s.softmax(-1)  # [Hq, n, K]
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        if start == 0:  # the observation window, then the one compression
            block_mass = torch.zeros(-(-L // bs)).index_add_(0, keys // bs, p[:, -window:].sum((0, 1)))
            full = list(range(prompt_len // bs))
            candidates = [c for c in full if c < (prompt_len - window) // bs]
            excess = min(len(full) + 1 - budget_blocks, len(candidates))
            for c in sorted(candidates, key=lambda c: (block_mass[c].item(), c))[:max(0, excess)]:
                kept[c * bs:(c + 1) * bs] = False
    return outs


@pytest.mark.parametrize("triton", [False, True])
def test_snapkv_paged_equals_dense_reference(triton):
    """Random Q/K/V (prompt 23, window 5, budget 3 blocks of 4): the block manager under SnapKV, the
    observation window the runner picks (observed_queries), the mass kernel on just those queries and the
    compacted table give, step by step, the dense SnapKV outputs over exactly the kept tokens."""
    g = torch.Generator().manual_seed(5)
    bs, Hq, Hkv, D, L, P, budget, w = 4, 4, 2, 16, 34, 23, 12, 5
    q, k, v = (torch.randn(L, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    want = dense_snapkv(q, k, v, P, budget // bs, w, bs)
    pol = SnapKV(budget, w, bs, max_chunk=P)
    bm = BlockManager(40, bs, eviction=pol)
    k_cache, v_cache = torch.zeros(40, bs, Hkv, D), torch.zeros(40, bs, Hkv, D)
    for (start, end), out_want in zip([(0, P)] + [(p, p + 1) for p in range(P, L)], want):
        assert bm.allocate_slots(7, end, end - start)
        table = bm.block_tables[7]
        for p in range(start, end):
            k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k[p], v[p]
        c = compact_tables([table + [NULL_BLOCK] * (10 - len(table))], [end], bs)
        t, lens = torch.as_tensor(c.table), torch.tensor(c.seq_lens, dtype=torch.int32)
        torch.testing.assert_close(attend_paged(triton, q[start:end], k_cache, v_cache, lens, t), out_want,
                                   rtol=1e-4, atol=1e-5)
        step = ModelInput([], [], [], [end], [], [end - start], [end - start - 1])  # one row that samples
        window, rows = observed_queries(step, w)
        if rows:
            idx, cu = window
            mass = kernel(attention_mass if triton else attention_mass_ref, torch.zeros(1, t.shape[1] * bs),
                          q[start:end][idx], k_cache, t, lens, cu, D ** -0.5)
            bm.observe_attention(block_masses(mass, c, [7], bs, rows))
    assert sum(b == NULL_BLOCK for b in bm.block_tables[7]) == P // bs + 1 - budget // bs  # compressed once
    assert observed_queries(ModelInput([], [], [], [9, 4], [], [1, 3], [0, 3]), 2)[0][1].tolist() == [0, 0, 2]


def test_snapkv_victims_spare_the_window_and_come_once():
    pol = SnapKV(kv_budget=12, window=4, block_size=4, max_chunk=32)  # 3 blocks
    table = [5, 6, 7, 8, 9]
    assert pol.victims(1, table, 20, None) == []  # no observation yet: nothing
    pol.observe(1, [0, 1, 2, 3, 4], [5.0, 1.0, 2.0, 3.0, 0.0])  # block 4 holds the window: the lightest, kept
    assert pol.victims(1, table, 20, None) == [1, 2, 3]
    assert pol.victims(1, [5, 0, 0, 0, 9, 10], 24, 4) == []  # once
    pol.forget(1)
    assert 1 not in pol.done and 1 not in pol.mass


@pytest.mark.slow
def test_snapkv_engine():
    """Through the engine: batched = alone; a budget no prompt reaches = the full cache; a small one
    differs from it."""
    model = tiny((None, None))
    ps = prompts(random.Random(9), [30, 5, 21])
    cfg = dict(block_size=4, num_gpu_blocks=64, kv_eviction="snapkv", snapkv_window=4)
    got, _ = run(model, ps, 20, kv_budget=12, **cfg)
    assert got[0] == run(model, ps[:1], 20, kv_budget=12, **cfg)[0][0]
    full, _ = run(model, ps, 20, kv_eviction="none", block_size=4, num_gpu_blocks=64)
    assert run(model, ps, 20, kv_budget=64, **cfg)[0] == full != got
