"""The host's share of a decode step, without a GPU (chapter 13): the engine's step with the model
replaced by random logits, so what is timed is scheduling, packing, sampling and bookkeeping; and
the block-table part alone, the padded lists converted per step against the worker's kept table.

    .venv/bin/python scripts/host_step_bench.py [--batch 256] [--context 1024] [--steps 100]

Numbers depend on the CPU; compare runs on one machine (git stash the change to get its "before").
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import make_tiny

from minillm import LLM, SamplingParams
from minillm.engine import BlockManager
from minillm.worker.block_table import PersistentBlockTable


def engine_step_ms(batch: int, context: int, steps: int, overlap: bool) -> float:
    """Median-free mean ms of engine.step() at `batch` decoding sequences of ~`context` tokens, the
    forward pass replaced by random logits (host work only)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny("llama3", Path(tmp), max_position_embeddings=context + steps + 64)
        llm = LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=batch, async_scheduling=overlap,
                  num_gpu_blocks=batch * ((context + steps + 64) // 16 + 2), max_num_batched_tokens=batch * context)
    engine, vocab = llm.engine, llm.engine.model.config.vocab_size
    engine.executor.worker.runner.execute = lambda step, prev=None: torch.randn(len(step.logits_indices), vocab)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]}, params)
    for _ in range(5):  # the prompts, then steady decode
        engine.step(unfinished_outputs=False)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step(unfinished_outputs=False)
    return 1e3 * (time.perf_counter() - t0) / steps


def table_us(batch: int, context: int, steps: int, block_size: int = 16) -> tuple[float, float]:
    """µs per decode step for the block tables: (padded lists -> torch.tensor, as every step did before
    chapter 13's kept table; the kept table: apply the step's changes, gather the rows)."""
    bm = BlockManager(batch * (context // block_size + steps // block_size + 4), block_size, track_changes=True)
    kept, lens = PersistentBlockTable(batch), {}
    for s in range(batch):
        lens[s] = context
        bm.allocate_slots(s, context, context)
    kept.apply(*bm.take_table_changes())
    order = list(range(batch))

    def grow():
        for s in order:
            lens[s] += 1
            bm.allocate_slots(s, lens[s], 1)

    t_old = t_new = 0.0
    for _ in range(steps):
        grow()
        t0 = time.perf_counter()
        tables = [bm.block_tables[s] for s in order]
        width = max(map(len, tables))
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [B, W]
        t1 = time.perf_counter()
        kept.apply(*bm.take_table_changes())
        torch.as_tensor(kept.gather(order))  # [B, W]
        t_old, t_new = t_old + t1 - t0, t_new + time.perf_counter() - t1
    return 1e6 * t_old / steps, 1e6 * t_new / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    old, new = table_us(a.batch, a.context, a.steps)
    print(f"block table, batch {a.batch}, {a.context}-token contexts: padded lists {old:,.0f} µs/step, "
          f"kept table {new:,.0f} µs/step ({old / new:.1f}x)")
    for overlap in (False, True):
        ms = engine_step_ms(a.batch, a.context, a.steps, overlap)
        print(f"engine.step() host only, batch {a.batch}, overlap {'on' if overlap else 'off'}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
