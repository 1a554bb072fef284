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
import time

import pytest
import torch
from tiny_models import random_model

from minillm import SamplingParams
from minillm.distributed.kv_transfer import shared_storage
from minillm.engine import EngineConfig, LLMEngine


def make_requests(rng: random.Random, vocab: int, count: int) -> list[tuple[list[int], int]]:
    system = [rng.randrange(vocab) for _ in range(rng.randrange(8, 24))]
    out = []
    for _ in range(count):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
        out.append(((system if rng.random() < 0.7 else []) + own, rng.randrange(2, 8)))
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


def engines(model, tok, kv_path, rng, overlap: bool, **kv):
    """A colocated engine, a producer and a consumer, each with its own copy of the model; overlap
    scheduling (chapter 13) on or off."""
    bs = rng.choice([1, 4, 16])
    common = dict(block_size=bs, num_gpu_blocks=400 // bs + 8, max_num_seqs=rng.randrange(2, 6),
                  async_scheduling=overlap)
    colocated = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(**common, max_num_batched_tokens=64))
    producer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, max_num_batched_tokens=rng.randrange(10, 30), enable_prefix_caching=rng.choice([None, "hash"]),
        kv_transfer_config={"kv_role": "producer", "kv_path": str(kv_path), **kv}))
    consumer = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(
        **common, max_num_batched_tokens=64, enable_prefix_caching=rng.choice([None, "hash", "radix"]),
        kv_transfer_config={"kv_role": "consumer", "kv_path": str(kv_path), **kv}))
    return colocated, producer, consumer


@pytest.mark.parametrize("case", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_disaggregated_tokens_equal_colocated(seed, tok, tmp_path, case):
    rng = random.Random(seed * 17 + case)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, rng.randrange(3, 5))
    colocated, producer, consumer = engines(model, tok, tmp_path, rng, overlap=case == 1)
    expected = run(colocated, requests)
    first = run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    assert all(first[f"r{i}"] == expected[f"r{i}"][:1] for i in range(len(requests)))
    got = run(consumer, requests, {"do_remote_prefill": True})
    assert got == expected
    # the consumer computed only each prompt's last token: the rest came from the producer
    assert consumer.engine_stats.num_prompt_tokens == len(requests)
    ps, cs = producer.stats, consumer.stats
    # a one-token prompt has nothing to send (its only token is the one the consumer computes anyway):
    # published, it would hold the producer's blocks until kv_send_timeout
    sent = sum(len(prompt) > 1 for prompt, _ in requests)
    assert ps["kv_transfers_saved"] == cs["kv_transfers_loaded"] == sent
    assert ps["kv_bytes_saved"] > 0 and cs["kv_bytes_loaded"] > 0
    assert producer.block_manager.num_used_blocks == 0 or producer.block_manager.prefix_cache is not None


@pytest.mark.parametrize("case", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_shared_pool_tokens_equal_colocated(seed, tok, tmp_path, case):
    """The pull transport: the consumer copies from the producer's own (shared-memory) pool, which keeps
    the blocks until the consumer says it has them."""
    rng = random.Random(seed * 31 + case)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, rng.randrange(3, 6))
    colocated, producer, consumer = engines(model, tok, tmp_path, rng, overlap=case == 0,
                                            kv_connector="SharedPoolConnector")
    expected = run(colocated, requests)
    run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    held = producer.block_manager.num_used_blocks
    sent = sum(len(prompt) > 1 for prompt, _ in requests)  # a one-token prompt has nothing to send
    assert len(producer.scheduler.sending) == sent and held > 0  # kept for the consumer
    got = run(consumer, requests, {"do_remote_prefill": True})
    assert got == expected
    assert consumer.engine_stats.num_prompt_tokens == len(requests)
    producer.step()  # the consumer's marks are read: every block is freed
    assert not producer.scheduler.sending and not producer.has_unfinished_requests()
    assert producer.block_manager.num_used_blocks < held
    assert consumer.stats["kv_bytes_loaded"] > 0
    producer.shutdown()


def small_engine(model, tok, overlap: bool = False, **kv) -> LLMEngine:
    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, async_scheduling=overlap,
                          kv_transfer_config=kv or None)
    return LLMEngine(copy.deepcopy(model), tok, [], config)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_missing_remote_kv_fails_clearly_or_is_prefilled_here(seed, tok, tmp_path, policy):
    """A handle whose K/V never comes waits kv_load_timeout, then fails with an error naming the transfer
    (policy "fail") or is prefilled locally (policy "recompute"); a request beside it is served either way."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, 2)
    expected = run(small_engine(model, tok), requests)
    consumer = small_engine(model, tok, overlap=policy == "fail", kv_role="consumer", kv_path=str(tmp_path),
                            kv_load_timeout=0.2, kv_load_failure_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=requests[0][1], ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "lost"}})
    consumer.add_request("lost", {"prompt_token_ids": requests[0][0]}, params)
    consumer.add_request("plain", {"prompt_token_ids": requests[1][0]},
                         SamplingParams(temperature=0.0, max_tokens=requests[1][1], ignore_eos=True))
    outs = {}
    while consumer.has_unfinished_requests():
        outs |= {o.request_id: o for o in consumer.step() if o.finished}
    assert outs["plain"].outputs[0].token_ids == expected["r1"]  # served beside the one that waits
    assert consumer.stats["kv_load_failures"] == 1
    lost = outs["lost"]
    if policy == "fail":
        assert lost.outputs[0].finish_reason == "error" and "did not arrive within kv_load_timeout" in lost.error
        assert "'lost'" in lost.error
    else:
        assert lost.error is None and lost.outputs[0].token_ids == expected["r0"]
    assert consumer.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("consumer_died", [False, True])
def test_unclaimed_transfer_is_freed_after_the_send_timeout(seed, tok, tmp_path, consumer_died):
    """A consumer that never comes (or claimed the transfer and died mid-copy): the producer frees the blocks
    it kept after kv_send_timeout (twice that for a claimed one), and keeps serving; a consumer that comes
    later gets a clear error instead of blocks someone else now owns."""
    rng = random.Random(seed + 1)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, 2)
    expected = run(small_engine(model, tok), requests)
    kv = dict(kv_connector="SharedPoolConnector", kv_path=str(tmp_path), kv_send_timeout=0.3)
    producer = small_engine(model, tok, kv_role="producer", **kv)
    run(producer, requests[:1], {"do_remote_decode": True}, max_tokens=1)
    assert producer.block_manager.num_used_blocks > 0 and producer.has_unfinished_requests()
    if consumer_died:  # its claim stays, its .done never comes
        (meta,) = tmp_path.glob("t0-*.json")
        (tmp_path / meta.name.replace(".json", ".claim")).touch()
    t0 = time.monotonic()
    while producer.has_unfinished_requests():  # nobody picks it up: the timeout frees the blocks
        producer.step()
    if consumer_died:  # waited for the claimant past the plain timeout (twice it, less the steps since publishing)
        assert time.monotonic() - t0 > 0.4
    assert producer.block_manager.num_used_blocks == 0 and producer.stats["kv_send_timeouts"] == 1
    assert run(producer, requests[1:], prefix="next") == {"next0": expected["r1"]}  # still serving
    consumer = small_engine(model, tok, kv_role="consumer", kv_load_timeout=0.2, **kv)
    got = run(consumer, requests[:1], {"do_remote_prefill": True})
    assert "did not arrive" in got["r0"]  # the transfer is gone: an error, never another request's blocks
    producer.shutdown()


def test_store_entries_nobody_picks_up_are_deleted(seed, tok, tmp_path, monkeypatch):
    monkeypatch.setattr(shared_storage, "REAP_EVERY", 0.0)
    rng = random.Random(seed + 2)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, 2)
    producer = small_engine(model, tok, kv_role="producer", kv_path=str(tmp_path), kv_send_timeout=60.0)
    run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    sent = sum(len(prompt) > 1 for prompt, _ in requests)  # a one-token prompt publishes nothing
    assert len(list(tmp_path.iterdir())) == sent and producer.block_manager.num_used_blocks == 0  # push: freed
    producer.step()
    assert len(list(tmp_path.iterdir())) == sent  # within the timeout: kept
    producer.kv_connector.config.kv_send_timeout = 0.0
    producer.step()
    assert list(tmp_path.iterdir()) == [] and producer.stats["kv_send_timeouts"] == sent


def test_handles_are_checked(seed, tok, tmp_path):
    rng = random.Random(seed)
    model, _ = random_model(rng)
    handle = lambda **p: SamplingParams(extra_args={"kv_transfer_params": p})
    with pytest.raises(ValueError, match="transfer_id"):
        handle(do_remote_prefill=True, transfer_id="../etc")
    with pytest.raises(ValueError, match="unknown field"):
        handle(do_remote_prefill=True, transfer_id="a", remote_host="x")
    with pytest.raises(TypeError, match="extra_args"):
        SamplingParams(extra_args=["kv"])
    with pytest.raises(ValueError, match="needs an engine with a KV connector"):
        small_engine(model, tok).add_request("a", "hi", handle(do_remote_prefill=True, transfer_id="a"))
    producer = small_engine(model, tok, kv_role="producer", kv_path=str(tmp_path))
    with pytest.raises(ValueError, match="kv_role is 'producer'"):
        producer.add_request("a", "hi", handle(do_remote_prefill=True, transfer_id="a"))
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineConfig(kv_transfer_config={"kv_role": "decoder"})


# ---- two processes: the producer's pool shared with a consumer in another process -------------------

def _two_process_side(role: str, seed: int, device: str, kv_path: str, out_path: str,
                      connector: str = "SharedPoolConnector") -> None:
    """One engine of a pair, in a spawned process: the producer (which also runs the colocated engine
    for the oracle) prefills and keeps stepping until the consumer has taken every transfer; the
    consumer's requests wait in WAITING_FOR_REMOTE_KVS until the producer publishes them."""
    import json

    from minillm.tokenizer import train_bpe
    from minillm.tokenizer.samples import FIXED

    rng = random.Random(seed)
    model, config = random_model(rng)
    model = model.to(device)
    tok = train_bpe("\n".join(FIXED), vocab_size=300)
    requests = make_requests(random.Random(seed + 1), config.vocab_size, 4)
    kv = {"kv_connector": connector, "kv_path": kv_path, "kv_role": role, "kv_load_timeout": 120.0,
          "kv_send_timeout": 120.0}
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16,
                                                    kv_transfer_config=kv))
    result = {}
    if role == "producer":
        colocated = LLMEngine(copy.deepcopy(model), tok, [], EngineConfig(block_size=4, num_gpu_blocks=128))
        result["expected"] = run(colocated, requests)
        run(engine, requests, {"do_remote_decode": True}, max_tokens=1)
        while engine.has_unfinished_requests():  # until the consumer's .done marks free the blocks
            engine.step()
        result["timeouts"] = engine.stats["kv_send_timeouts"]
    else:
        result["got"] = run(engine, requests, {"do_remote_prefill": True})
        result["stats"] = engine.stats
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC)")]


@pytest.mark.parametrize("device, connector", [
    pytest.param("cpu", "SharedPoolConnector", marks=pytest.mark.slow),
    pytest.param("cuda", "SharedPoolConnector", marks=_CUDA),
    pytest.param("cuda", "CudaIpcConnector", marks=_CUDA)])
def test_shared_pool_across_processes(seed, tmp_path, device, connector):
    """CUDA IPC on one GPU (shared memory on a CPU): the consumer maps the producer's pool from another
    process and decodes the colocated tokens; the producer frees every block once the consumer is done."""
    import json
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_process_side, args=(role, seed, device, str(tmp_path / "kv"),
                                                         str(tmp_path / f"{role}.json"), connector))
             for role in ("producer", "consumer")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, f"the {p} side failed"
    producer = json.loads((tmp_path / "producer.json").read_text())
    consumer = json.loads((tmp_path / "consumer.json").read_text())
    assert consumer["got"] == producer["expected"] and producer["timeouts"] == 0
    assert consumer["stats"]["kv_transfers_loaded"] == 4 and consumer["stats"]["num_prompt_tokens"] == 4


def test_layer_hooks_run_inside_the_forward_pass_in_layer_order(seed, tok, tmp_path):
    """The worker's hooks come from each attention layer through the forward context: layer i's load is
    awaited and its save handed off before layer i + 1 runs, between start_load_kv and wait_for_save."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = make_requests(rng, config.vocab_size, 1)
    producer = small_engine(model, tok, kv_role="both", kv_path=str(tmp_path))
    connector, calls = producer.executor.worker.kv_connector, []
    for name in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"):
        real = getattr(connector, name)

        def spy(*args, _real=real, _name=name):
            calls.append((_name, connector._index[id(args[0])] if args else None))
            return _real(*args)

        setattr(connector, name, spy)
    run(producer, requests, {"do_remote_decode": True}, max_tokens=1)
    layers = config.num_layers
    per_step = ([("start_load_kv", None)] + [(h, i) for i in range(layers)
                                             for h in ("wait_for_layer_load", "save_kv_layer")]
                + [("wait_for_save", None)])
    steps = -(-len(requests[0][0]) // 32)  # the prompt's chunks (max_num_batched_tokens=32)
    assert calls == per_step * steps
