"""Chapter 09, part two: self-distillation lowers a drafter's loss, and a saved drafter loads by path and
drafts in the engine (greedy output still the plain one's). Tiny random model, a few steps, CPU."""

from __future__ import annotations

import random

import pytest
from test_engine import alone
from test_spec_engine import drain
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.spec_decode.drafter_files import save_drafter
from minillm.spec_decode.medusa import MedusaHeads
from minillm.spec_decode.train_drafter import train


@pytest.mark.slow
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_lowers_the_loss_and_the_saved_drafter_serves(seed, tok, method, tmp_path):
    rng = random.Random(seed + len(method))
    model, config = random_model(rng)
    # what the target says itself: greedy continuations of random prompts (self-distillation's data)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(2, 8))] for _ in range(6)]
    corpus = [p + alone(model, tok, p, greedy)[0] for p in prompts]
    drafter, losses = train(method, model, corpus, num_heads=3, steps=60, lr=3e-3, batch_size=3, seed=seed)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    # the soft cross-entropy cannot fall below the target's own entropy (high for a random tiny model), so
    # the bound asks for a clear fall, not a large one
    assert last < 0.97 * first, (method, losses)
    folder = save_drafter(tmp_path / method, drafter.config, drafter)
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, speculative_config={
        "method": method, "model": str(folder), "num_speculative_tokens": 3}))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy)
    got = drain(engine)
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == [c[len(p):] for c, p in zip(corpus, prompts)]
    assert engine.engine_stats.spec.num_draft_tokens > 0


def test_a_drafter_folder_for_another_model_is_refused(seed, tok, tmp_path):
    rng = random.Random(seed)
    model, config = random_model(rng)
    heads = MedusaHeads(32, config.vocab_size, 2)
    folder = save_drafter(tmp_path / "m", heads.config, heads)
    with pytest.raises(ValueError, match="hidden_size"):
        LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, speculative_config={
            "method": "medusa", "model": str(folder), "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="medusa"):
        LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, speculative_config={
            "method": "eagle", "model": str(folder), "num_speculative_tokens": 2}))
