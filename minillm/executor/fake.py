"""FakeExecutor: the engine without a model, for tests that must run in seconds (chapter 13, issue 42).

What the scheduler, the block manager, preemption, prefix caching, speculative rollback and overlap
scheduling get right or wrong shows in *which cached keys a step reads*, not in what a transformer
makes of them. So this executor keeps a "KV cache" of token ids: every step writes each new token's
id (and position) into its slot, and the next-token distribution of a row is a fixed random function
of the tokens it reads back through the step's block table, positions 0..p, in order:

    h       = sum_j  token[j] * R[j]  mod P        (R: fixed random weights, one per position)
    logits  = TABLE[h mod M]                       [V], fixed random rows
              + 8 at the token that followed the last earlier occurrence of token[p], when h mod 3 != 0

A block table that points at the wrong block, a swap that loses one, a prefix-cache hit on different
tokens, a draft whose slot was not rolled back: each changes h, hence the tokens, so the engine's own
oracle (a batch = each request alone) catches it. A slot read before anything was written to it, or
holding another position's token, raises at once. The logits go through the real StepSampler, so
greedy, seeded sampling, logprobs, n > 1, token masks and verification are the engine's own code.
Chapter 09's n-gram drafter runs here too (it needs no model).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..worker.block_table import PersistentBlockTable
from ..worker.model_input import ModelInput, ModelRunnerOutput
from ..worker.sample_step import StepSampler, sample_deferred, sample_step
from .abstract import Executor

_P = (1 << 31) - 1  # a prime: h stays an exact int64 (token < 2^17, R < 2^20, positions < 2^14)


class FakeModel:
    """What LLMEngine reads of a model when the executor is fake: its vocabulary size."""

    def __init__(self, vocab_size: int):
        self.config = SimpleNamespace(vocab_size=vocab_size)


class FakeTokenizer:
    """Token ids as text ("<7>"), for the engine's logprob entries and text: the fake has no vocabulary."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        return self.decode(ids).encode()


class FakeExecutor(Executor):
    def __init__(self, config, vocab_size: int = 64, max_model_len: int = 256, num_gpu_blocks: int = 64,
                 num_cpu_blocks: int = 0, seed: int = 0, table_rows: int = 64):
        if max_model_len >= 1 << 14:
            raise ValueError(f"max_model_len must be below {1 << 14} for the fake cache's hash, not {max_model_len}")
        rng = np.random.default_rng(seed)
        self.config, self.vocab_size, self.block_size = config, vocab_size, config.block_size
        self.weights = rng.integers(1, 1 << 20, size=max_model_len, dtype=np.int64)  # R [max_model_len]
        self.table = torch.from_numpy(rng.normal(0.0, 3.0, size=(table_rows, vocab_size)).astype(np.float32))
        # the fields of the engine's ResolvedSizes it reads (engine/config.py: a tier above this one)
        # (the offload tier's slots: kv_offload_blocks; the fake's blocks have no size to divide GiB by)
        self.sizes = SimpleNamespace(max_model_len=max_model_len, num_gpu_blocks=num_gpu_blocks,
                                     num_cpu_blocks=num_cpu_blocks, block_bytes=0, kv_cache_spec=(),
                                     device=torch.device("cpu"),
                                     num_offload_blocks=config.num_offload_blocks(0) if getattr(config, "offloads", False) else 0)
        self.sampler = StepSampler(config.max_num_seqs)
        self.last_sampled: torch.Tensor | None = None
        self.proposer = None
        self.num_steps = 0

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.sizes.num_gpu_blocks, self.sizes.num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, progress: bool = True) -> None:
        bs = self.block_size
        # [blocks * bs] token id and position of each slot; -1: never written (or swapped out)
        self.gpu = np.full((2, num_gpu_blocks * bs), -1, dtype=np.int64)
        self.cpu = np.full((2, max(num_cpu_blocks, 1) * bs), -1, dtype=np.int64)
        self.offloaded = np.full((2, max(self.sizes.num_offload_blocks, 1) * bs), -1, dtype=np.int64)  # its slots
        self.tables = PersistentBlockTable(self.config.max_num_seqs, -(-self.sizes.max_model_len // bs))
        spec = self.config.speculative_config
        if spec is not None:
            if spec.method != "ngram":
                raise ValueError(f"FakeExecutor drafts only with method 'ngram' (it has no model), not {spec.method!r}")
            from ..spec_decode.ngram import NgramProposer  # lazy: only a speculative engine needs it

            self.proposer = NgramProposer(spec)

    def _blocks(self, pool: np.ndarray, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()) -> None:
        # a swapped-out GPU block keeps its contents, as on a GPU: another sequence (or the prefix cache)
        # may still hold it
        for gpu_block, cpu_block in swap_out:
            self.cpu[:, self._blocks(self.cpu, cpu_block)] = self.gpu[:, self._blocks(self.gpu, gpu_block)]
        # chapter 15's offload tier, in cache/offload.py's order: read every saved block, write the slots,
        # then restore (a restore may target a block just saved, or read a slot just written)
        saved = [self.gpu[:, self._blocks(self.gpu, b)].copy() for b, _ in offload_save]
        for data, (_, slot) in zip(saved, offload_save):
            self.offloaded[:, self._blocks(self.offloaded, slot)] = data
        for slot, gpu_block in offload_load:
            self.gpu[:, self._blocks(self.gpu, gpu_block)] = self.offloaded[:, self._blocks(self.offloaded, slot)]
        for cpu_block, gpu_block in swap_in:
            self.gpu[:, self._blocks(self.gpu, gpu_block)] = self.cpu[:, self._blocks(self.cpu, cpu_block)]
        for src, dst in copies:
            self.gpu[:, self._blocks(self.gpu, dst)] = self.gpu[:, self._blocks(self.gpu, src)]

    def propose(self, seqs, num_spec, table_changes):
        self.tables.apply(*table_changes)
        return self.proposer.propose(seqs, num_spec, self.tables)

    def _logits(self, step: ModelInput, table: np.ndarray) -> torch.Tensor:
        """-> [R, V] fp32: each logits row's function of the tokens its sequence reads back."""
        ids = np.asarray(step.input_ids, dtype=np.int64)  # [T]
        if step.prev_token_dst:  # overlap: the rows the previous step sampled, as the GPU would fill them
            if self.last_sampled is None:
                raise ValueError("this step takes tokens sampled by the previous one, but none were given")
            prev = self.last_sampled.cpu().numpy()
            ids[step.prev_token_dst] = prev[step.prev_token_src]
        slots, pos = np.asarray(step.slot_mapping), np.asarray(step.positions, dtype=np.int64)
        written = slots >= 0
        self.gpu[0, slots[written]], self.gpu[1, slots[written]] = ids[written], pos[written]
        starts = np.cumsum([0, *step.query_lens])  # [B + 1] each sequence's first token row
        seq_of = np.searchsorted(starts, step.logits_indices, side="right") - 1  # [R]
        rows, boost = [], []
        for t, b in zip(step.logits_indices, seq_of):
            p = int(pos[t])
            j = np.arange(p + 1)  # positions 0..p, read through the sequence's block table
            read = table[b][j // self.block_size] * self.block_size + j % self.block_size
            tokens, where = self.gpu[0, read], self.gpu[1, read]
            if (bad := np.flatnonzero(where != j)).size:
                raise AssertionError(f"step {self.num_steps}: sequence row {b} reads position {int(j[bad[0]])} from "
                                     f"slot {int(read[bad[0]])}, which holds position {int(where[bad[0]])} (-1: none)")
            h = int((tokens * self.weights[: p + 1]).sum() % _P)
            rows.append(h % len(self.table))
            # an "induction head", two times in three: the token that followed the last earlier
            # occurrence of this one is favoured, so n-gram drafts are accepted often, rejected sometimes
            seen = np.flatnonzero(tokens[:p] == tokens[p])
            boost.append(int(tokens[seen[-1] + 1]) if seen.size and h % 3 else -1)
        logits = self.table[rows].clone()  # [R, V]
        hit = [i for i, b in enumerate(boost) if b >= 0]
        logits[hit, [boost[i] for i in hit]] += 8.0
        return logits

    def execute_model(self, model_input: ModelInput) -> ModelRunnerOutput:
        step = model_input
        if step.seq_ids:
            self.tables.apply(step.dropped_tables, step.table_updates)
            table = self.tables.gather(step.seq_ids)  # [B, W]
        else:
            table = np.asarray(step.block_table, dtype=np.int64)
        logits = self._logits(step, table)
        self.num_steps += 1
        out, on_device = sample_step(self.sampler, logits, step.sampling)
        if out is None:  # the grammars' bitmask comes with sample_tokens
            return None
        self.last_sampled = on_device if on_device is not None else self.last_sampled
        return out

    def sample_tokens(self, bitmask) -> ModelRunnerOutput:
        out, on_device = sample_deferred(self.sampler, bitmask)
        self.last_sampled = on_device if on_device is not None else self.last_sampled
        return out

    def capture_token_buckets(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
