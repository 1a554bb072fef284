"""The fused MoE kernel (kernels/fused_moe.py) against the per-expert loop on fresh random inputs:
under Triton's interpreter on a CPU with small shapes, natively on a GPU with real ones (M = 4096).

MoE: both sides compute each expert's SwiGLU MLP in x's dtype with fp32 sums; in fp32 (IEEE dots)
they agree to ~1e-6, in fp16/bf16 to the rounding of the intermediate (the kernel keeps silu(gate) *
up in fp32 until its store, the loop rounds gate_up first), relative ~1e-3 (vLLM's test: atol 2e-2).
"""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels import fused_moe
from minillm.kernels.fused_moe import (
    CONFIG_KEYS,
    align_unsorted,
    config_file_name,
    default_config,
    fused_experts,
    fused_experts_ref,
    load_configs,
    moe_align_block_size,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative (Frobenius) error


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routing(g, M: int, E: int, top_k: int, skew: bool = False):
    """top_k distinct experts per token; skew=True routes every token among the first top_k + 1
    experts, so most experts get no tokens at all."""
    pool = min(E, top_k + 1) if skew else E
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, top_k, generator=g)
    return weights.to(DEVICE), ids.to(DEVICE)


def experts(g, E: int, H: int, I: int, dtype):
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(DEVICE, dtype)
    return w13, w2


SHAPES = [(1, 8, 2), (2, 64, 6), (7, 64, 6), (33, 8, 8), (222, 64, 6)]  # (1, 8, 2), (2, 64, 6): no sort + ([] if INTERPRETED else [(4096, 64, 6), (4096, 8, 2)])


@pytest.mark.parametrize("M,E,top_k", SHAPES)
@pytest.mark.slow
def test_fused_moe_matches_the_per_expert_loop(seed, M, E, top_k):
    g = torch.Generator().manual_seed(seed)
    H, I = (48, 40) if INTERPRETED else (2048, 1408)  # odd tiles on the CPU; DeepSeek-V2-Lite's on a GPU
    for dtype in DTYPES:
        x = torch.randn(M, H, generator=g).to(DEVICE, dtype)
        w13, w2 = experts(g, E, H, I, dtype)
        weights, ids = routing(g, M, E, top_k, skew=M > 30)
        got = fused_experts(x, w13, w2, weights, ids)
        want = fused_experts_ref(x, w13, w2, weights, ids)
        assert got.shape == x.shape and got.dtype == dtype
        assert rel(got, want) < TOL[dtype], (dtype, rel(got, want))


def test_align_sorts_pairs_by_expert_and_pads_each_run(seed):
    g = torch.Generator().manual_seed(seed)
    M, E, top_k, block = 13, 8, 3, 4
    _, ids = routing(g, M, E, top_k, skew=True)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, block, E)
    n, flat = M * top_k, ids.reshape(-1).cpu()
    sorted_ids, expert_ids, total = sorted_ids.cpu(), expert_ids.cpu(), int(total)
    counts = torch.bincount(flat.long(), minlength=E)
    assert total == int(((counts + block - 1) // block * block).sum())
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair exactly once
    assert (sorted_ids[total:] == n).all()  # nothing real after the padded end
    for tile in range(total // block):  # a tile's real rows all belong to its expert
        rows = real[tile * block:(tile + 1) * block]
        assert (flat[rows[rows < n].long()] == expert_ids[tile]).all()


@pytest.mark.parametrize("block_m,group", [(16, 1), (32, 3), (16, 1 << 20)])
def test_any_tiles_and_launch_order_give_the_loop_s_result(seed, block_m, group):
    """Explicit configs (as a tuned table would give): other row tiles, launch groups that do not
    divide the row tiles, and one group over all of them (the old order) change nothing."""
    g = torch.Generator().manual_seed(seed)
    M, E, top_k, H, I = 29, 8, 3, 48, 40
    x = torch.randn(M, H, generator=g).to(DEVICE)
    w13, w2 = experts(g, E, H, I, torch.float32)
    weights, ids = routing(g, M, E, top_k)
    cfg = dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=group, num_warps=4, num_stages=1)
    got = fused_experts(x, w13, w2, weights, ids, config=cfg)
    assert rel(got, fused_experts_ref(x, w13, w2, weights, ids)) < TOL[torch.float32]
    with pytest.raises(ValueError, match="config must have exactly the keys"):
        fused_experts(x, w13, w2, weights, ids, config={"BLOCK_M": 16})


def test_align_unsorted_gives_each_pair_its_own_tile(seed):
    g = torch.Generator().manual_seed(seed)
    _, ids = routing(g, 2, 64, 6)
    sorted_ids, expert_ids, total = align_unsorted(ids, 16)
    assert int(total) == 12 * 16 and sorted_ids.numel() == 12 * 16
    assert sorted_ids.view(12, 16)[:, 0].tolist() == list(range(12)) and (sorted_ids.view(12, 16)[:, 1:] == 12).all()
    assert expert_ids.tolist() == ids.reshape(-1).tolist()


def test_tuned_table_is_read_and_the_fallback_never_uses_k32(tmp_path, monkeypatch):
    table = {"_header": "x", "1": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_SIZE_M=1, num_warps=4,
                                       num_stages=4, us=3.0),
             "4096": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)}
    name = config_file_name(128, 768, "NVIDIA H100 80GB HBM3", torch.bfloat16)
    assert name == "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=bfloat16.json"
    (tmp_path / name).write_text(__import__("json").dumps(table))
    monkeypatch.setattr(fused_moe, "CONFIG_DIR", str(tmp_path))
    load_configs.cache_clear()
    try:
        got = load_configs(128, 768, "NVIDIA H100 80GB HBM3", torch.bfloat16)
        assert got == {1: {k: table["1"][k] for k in CONFIG_KEYS}, 4096: table["4096"]}
        assert load_configs(64, 768, "NVIDIA H100 80GB HBM3", torch.bfloat16) is None
    finally:
        load_configs.cache_clear()
    monkeypatch.setattr(fused_moe, "INTERPRET", False)
    for M in (1, 16, 256, 1024, 4096, 16384):
        cfg = default_config(M, 128, 8, torch.bfloat16)
        assert sorted(cfg) == sorted(CONFIG_KEYS) and cfg["BLOCK_K"] >= 64
    assert default_config(8192, 128, 8, torch.bfloat16)["BLOCK_M"] == 128


def test_tuner_candidates_and_cpu_refusal():
    from minillm.bench import moe as bench_moe
    from minillm.bench.moe_tune import candidates, old_configs

    for per_expert in (0.05, 3, 20, 100, 500):
        for cfg in candidates(per_expert) + old_configs(per_expert):
            assert sorted(cfg) == sorted(CONFIG_KEYS) and cfg["BLOCK_K"] >= 64
            assert cfg["BLOCK_M"] * cfg["BLOCK_N"] <= 128 * 128 or cfg["num_warps"] == 8  # gate_up: 2 accumulators
    with pytest.raises(ValueError, match="--tune times kernels: it needs a CUDA device"):
        bench_moe.run(device="cpu", tune=True)


def test_checked_in_tables_are_well_formed():
    import json
    import os

    folder = fused_moe.CONFIG_DIR
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        with open(os.path.join(fused_moe.CONFIG_DIR, name)) as f:
            table = json.load(f)
        for m, cfg in table.items():
            if not m.startswith("_"):
                assert int(m) >= 1 and all(isinstance(cfg[k], int) for k in CONFIG_KEYS), (name, m)
                assert cfg["BLOCK_K"] >= 64, (name, m)  # the tuner's candidates never take K = 32


def test_fused_moe_bad_arguments_are_clear_errors():
    x = torch.randn(3, 32, device=DEVICE)
    w13, w2 = torch.randn(4, 16, 32, device=DEVICE), torch.randn(4, 32, 8, device=DEVICE)
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32, device=DEVICE)
    w = torch.rand(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"top_k \(5\) must be <= the number of experts \(4\)"):
        fused_experts(x, w13, w2, torch.rand(3, 5, device=DEVICE), torch.zeros(3, 5, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="w13 \\[E, 2I, H\\] and w2 \\[E, H, I\\]"):
        fused_experts(x, w13, w2[:, :, :4], w, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights must both be"):
        fused_experts(x, w13, w2, w[:2], ids)
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor"):
        fused_experts(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="x must be 2-D"):
        fused_experts_ref(x[None], w13, w2, w, ids)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(seed):
    """Captured once, replayed with other tokens routed elsewhere (also all to the same experts): the
    expert counts never reach the host, so the graph's result follows the new routing."""
    g = torch.Generator().manual_seed(seed)
    M, E, top_k, H, I = 64, 64, 6, 2048, 1408
    w13, w2 = experts(g, E, H, I, torch.bfloat16)
    x = torch.randn(M, H, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = routing(g, M, E, top_k)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for skew in (False, True):
        new_w, new_ids = routing(g, M, E, top_k, skew=skew)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.copy_(torch.randn(M, H, generator=g).to(DEVICE, torch.bfloat16))
        graph.replay()
        assert rel(out, fused_experts_ref(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]
