"""Chapter 17's oracle: disaggregated prefill and decode give the colocated engine's tokens.

A producer engine prefills each prompt (max_tokens=1) and saves its K/V through a KV connector; a
consumer engine loads them and decodes. Greedy fp32 on a CPU, random tiny models, several requests
with shared prefixes, chunked prefill on the producer, prefix caching on either side: every
completion equals what one colocated engine gives, and the consumer computed only each prompt's last
token. The faults: a remote K/V that never comes (a clear error, or a local prefill), a transfer
nobody picks up (the producer lets it go after kv_send_timeout and keeps serving).
"""

from __future__ import annotations

import copy
import random

import pytest
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine


def make_requests(rng: random.Random, vocab: int, count: int) -> list[tuple[list[int], int]]:
    system = [rng.randrange(vocab) for _ in range(rng.randrange(8, 30))]
    out = []
    for _ in range(count):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        out.append(((system if rng.random() < 0.7 else []) + own, rng.randrange(2, 12)))
    return out


def run(engine: LLMEngine, requests, handle=None, max_tokens=None, prefix="r") -> dict[str, list[int]]:
    """Every request at once; -> request id -> output token ids (the error text for a failed one)."""
    for i, (prompt, n) in enumerate(requests):
        extra = {"kv_transfer_params": {**handle, "transfer_id": f"t{i}"}} if handle else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens or n, ignore_eos=True, extra_args=extra)
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests() and len(done) < len(requests):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.error or out.outputs[0].token_ids
    return done


def engines(model, tok, kv_path, rng, **kv):
    """A colocated engine, a producer and a consumer, each with its own copy of the model."""
    bs = rng.choice([1, 4, 16])
    common = dict(block_size=bs, num_gpu_blocks=400 // bs + 8, max_num_seqs=rng.randrange(2, 6))
    colocated = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(**common, max_num_batched_tokens=64))
    producer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, max_num_batched_tokens=rng.randrange(8, 24), enable_prefix_caching=rng.choice([None, "hash"]),
        kv_transfer_config={"kv_role": "producer", "kv_path": str(kv_path), **kv}))
    consumer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, max_num_batched_tokens=64, enable_prefix_caching=rng.choice([None, "hash", "radix"]),
        kv_transfer_config={"kv_role": "consumer", "kv_path": str(kv_path), **kv}))
    return colocated, producer, consumer


@pytest.mark.parametrize("case", range(3))
def test_disaggregated_tokens_equal_colocated(seed, tok, tmp_path, case):
    rng = random.Random(seed * 17 + case)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, rng.randrange(3, 7))
    colocated, producer, consumer = engines(model, tok, tmp_path, rng)
    expected = run(colocated, requests)
    first = run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    assert all(first[f"r{i}"] == expected[f"r{i}"][:1] for i in range(len(requests)))
    got = run(consumer, requests, {"do_remote_prefill": True})
    assert got == expected
    # the consumer computed only each prompt's last token: the rest came from the producer
    assert consumer.engine_stats.num_prompt_tokens == len(requests)
    ps, cs = producer.stats, consumer.stats
    assert ps["kv_transfers_saved"] == cs["kv_transfers_loaded"] == len(requests)
    assert ps["kv_bytes_saved"] > 0 and cs["kv_bytes_loaded"] > 0
    assert producer.block_manager.num_used_blocks == 0 or producer.block_manager.prefix_cache is not None
