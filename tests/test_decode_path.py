"""Chapter 13's short path for a decode-only step (SchedulerOutput.decode_only): the ModelInput that
prepare_decode_input builds is the one the general prepare_model_input builds for the same step, with
and without overlap scheduling (pending tokens), through chunked prompts, n > 1 forks and a small pool;
and Sequence.num_tokens, kept as a field, always equals len(token_ids) + num_pending."""

from __future__ import annotations

import random

import pytest
import torch

from minillm import SamplingParams
from minillm.bench.serving_setup import NoTextTokenizer
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.step_input import prepare_decode_input, prepare_model_input
from minillm.loader import load_model

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256, name="tiny")


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_only_input_equals_the_general_one(seed, overlap):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model, _, _ = load_model(TINY, load_format="dummy")
    # a small pool and budget: prompts are chunked, and sequences preempted when the pool runs short
    config = EngineConfig(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16, max_num_seqs=6,
                          async_scheduling=overlap)
    engine = LLMEngine(model, NoTextTokenizer(), [], config, progress=False)
    bm, checked, general_only = engine.block_manager, [], []

    def prepare(sched, logits_indices):
        changes = bm.take_table_changes()  # once: taking them empties the record
        want = prepare_model_input(sched.scheduled, bm.block_tables, bm.block_size, logits_indices, changes)
        for s, _ in sched.scheduled:
            assert s.num_tokens == len(s.token_ids) + s.num_pending
        if sched.decode_only:
            seqs = [s for s, _ in sched.scheduled]
            assert logits_indices == list(range(len(seqs)))
            assert prepare_decode_input(seqs, bm.block_tables, bm.block_size, changes) == want
            padded = prepare_model_input(sched.scheduled, bm.block_tables, bm.block_size, logits_indices)
            assert prepare_decode_input(seqs, bm.block_tables, bm.block_size) == padded
            checked.append(bool(want.prev_token_dst))
        else:
            general_only.append(1)
        return want

    engine._prepare = prepare
    for i in range(8):
        prompt = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True, n=1 + (i % 3 == 0))
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert checked and general_only  # both paths ran
    assert any(checked) == overlap  # overlapped decode steps take their tokens from the GPU
