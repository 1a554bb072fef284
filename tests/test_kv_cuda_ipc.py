"""Chapter 17's CUDA IPC connector on a CPU: the handle protocol (export once, open once, checked),
the block mapping (runs of rows consecutive on both sides), the one-pass copy kernel against its
plain-PyTorch reference (Triton's interpreter on a CPU, native on a GPU), an engine pair through the
connector with a fake in place of CUDA IPC, and the refusal of a real one on a CPU. The two-process run on a GPU is
tests/test_kv_transfer.py::test_shared_pool_across_processes[cuda-CudaIpcConnector].
"""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch
from test_kv_transfer import make_requests, run
from tiny_models import random_model

from minillm.distributed import kv_transfer
from minillm.distributed.kv_transfer import KVTransferError, cuda_ipc
from minillm.engine import EngineConfig, LLMEngine
from minillm.kernels.kv_block_copy import copy_rows, copy_rows_reference, copy_runs

# the copy kernel runs under Triton's interpreter on CPU tensors, or natively on CUDA ones (conftest.py
# sets TRITON_INTERPRET only where there is no GPU)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

_OPEN: dict[int, torch.Tensor] = {}  # the fake's "device memory": what a handle maps to


def _rebuild(key: int) -> torch.Tensor:
    return _OPEN[key]


def fake_reduce(t: torch.Tensor):
    """reduce_tensor's shape, (rebuild, args), with an in-process table in place of cudaIpcMemHandle."""
    _OPEN[id(t)] = t
    return _rebuild, (id(t),)


def random_tables(rng: random.Random, num_blocks: int, bs: int, n_tokens: int) -> list[int]:
    table = rng.sample(range(num_blocks), -(-n_tokens // bs))
    if rng.random() < 0.5:  # a fresh pool hands out consecutive blocks: long runs
        table.sort()
    return table


def test_runs_cover_exactly_the_rows(seed):
    rng = random.Random(seed)
    for _ in range(20):
        bs, n = rng.choice([1, 4, 16]), rng.randrange(1, 200)
        start = rng.randrange(0, n)
        src_t, dst_t = random_tables(rng, 256, bs, n), random_tables(rng, 256, bs, n)
        src = [src_t[p // bs] * bs + p % bs for p in range(start, n)]
        dst = [dst_t[p // bs] * bs + p % bs for p in range(start, n)]
        max_rows = rng.choice([3, 64])
        runs = copy_runs(src, dst, max_rows)
        pairs = [(s + k, d + k) for s, d, m in runs.tolist() for k in range(m)]
        assert pairs == list(zip(src, dst))
        assert runs[:, 2].max() <= max_rows
        # a run is never cut where both sides go on (unless it is max_rows long)
        for (s0, d0, m0), (s1, d1, _) in zip(runs.tolist(), runs[1:].tolist()):
            assert m0 == max_rows or s1 != s0 + m0 or d1 != d0 + m0
    with pytest.raises(ValueError, match="one length"):
        copy_runs([1, 2], [3])


@pytest.mark.parametrize("row_bytes", [24, 12, 6])  # int64, int32 and byte words
def test_copy_kernel_equals_reference(seed, row_bytes):
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    src = torch.randint(0, 256, (80, row_bytes), dtype=torch.uint8, generator=g).to(DEVICE)
    dst = torch.randint(0, 256, (96, row_bytes), dtype=torch.uint8, generator=g).to(DEVICE)
    s, d = rng.sample(range(80), 30), rng.sample(range(20, 96), 20)  # no destination twice
    s[5:15] = range(40, 50)
    d[5:5] = range(10, 20)  # one long run among single rows
    runs = torch.from_numpy(copy_runs(s, d, max_rows=4)).to(DEVICE)
    want = dst.clone()
    copy_rows_reference(src, want, runs)
    assert torch.equal(want[d], src[s])
    copy_rows(src, dst, runs, max_rows=4)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="rows differ"):
        copy_rows(src, torch.zeros(4, row_bytes + 1, dtype=torch.uint8, device=DEVICE), runs)
    with pytest.raises(TypeError, match="uint8 row views"):
        copy_rows(src.float(), dst, runs)


def test_handles_are_exported_once_and_checked():
    k = [torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)]
    v = [torch.randn(3, 4, 2, 8), None]
    h = cuda_ipc.export_pool(k, v, fake_reduce)
    rk, rv = cuda_ipc.open_pool(h, "pool-1", torch.device("cpu"))
    assert rk[0].data_ptr() == k[0].data_ptr() and rv[1] is None  # the same memory, not a copy
    assert rk[1].shape == (12, 2 * 8 * 4) and rk[1].dtype == torch.uint8
    with pytest.raises(KVTransferError, match="not CUDA IPC"):
        cuda_ipc.open_pool({**h, "transport": "shm"}, "pool-1", torch.device("cpu"))
    with pytest.raises(KVTransferError, match=r"exported as torch.float32\(3, 4, 2, 9\)"):
        cuda_ipc.open_pool({**h, "k_shapes": [(3, 4, 2, 9), (3, 4, 2, 8)]}, "pool-1", torch.device("cpu"))


class FakeIpcConnector(cuda_ipc.CudaIpcConnector):
    reduce = staticmethod(fake_reduce)
    needs_cuda = False


def test_engine_pair_over_the_fake_equals_colocated(seed, tok, tmp_path, monkeypatch):
    """The connector's whole path (export at start, claim, open, plan runs, copy each layer in its
    forward pass, .done, the producer frees) with the fake handles: the colocated tokens."""
    monkeypatch.setitem(kv_transfer.CONNECTORS, "CudaIpcConnector", FakeIpcConnector)
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, 3)
    bs = rng.choice([4, 16])
    common = dict(block_size=bs, num_gpu_blocks=400 // bs + 8, max_num_seqs=4)
    kv = dict(kv_connector="CudaIpcConnector", kv_path=str(tmp_path))
    colocated = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(**common))
    producer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, max_num_batched_tokens=rng.randrange(10, 30), kv_transfer_config={**kv, "kv_role": "producer"}))
    consumer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, kv_transfer_config={**kv, "kv_role": "consumer"}))
    expected = run(colocated, requests)
    run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    held = producer.block_manager.num_used_blocks
    assert held > 0
    assert run(consumer, requests, {"do_remote_prefill": True}) == expected
    assert consumer.engine_stats.num_prompt_tokens == len(requests)  # only each prompt's last token
    producer.step()
    assert producer.block_manager.num_used_blocks < held and not producer.scheduler.sending
    sent = sum(len(p) > 1 for p, _ in requests)
    assert consumer.stats["kv_transfers_loaded"] == sent
    rows = sum(len(p) - 1 for p, _ in requests if len(p) > 1)  # every prompt token but the last, K and V
    assert consumer.stats["kv_bytes_loaded"] == rows * config.num_layers * 2 * config.num_kv_heads * \
        config.head_dim * 4


def test_refused_on_a_cpu(tok, tmp_path):
    model, _ = random_model(random.Random(0))
    with pytest.raises(ValueError, match="CudaIpcConnector shares a GPU's KV pool.*SharedPoolConnector"):
        LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=16, kv_transfer_config={
            "kv_connector": "CudaIpcConnector", "kv_role": "producer", "kv_path": str(tmp_path)}))


def test_runs_of_a_fresh_pool_are_long():
    """Why the plan pays: consecutive blocks on both sides make one run per MAX_RUN_ROWS rows."""
    src = list(range(32, 32 + 256))
    dst = list(range(1000, 1000 + 256))
    assert len(copy_runs(src, dst)) == 4 and np.all(copy_runs(src, dst)[:, 2] == 64)
