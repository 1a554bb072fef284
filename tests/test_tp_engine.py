"""Chapter 11's engine oracle: `LLM(tensor_parallel_size=N)` (this process rank 0, N - 1 worker processes,
gloo on CPU) makes the greedy tokens of the same model at size 1, with batching, preemption, prefix
caching and chunked prompts on; bad settings fail before any process starts; a worker that dies ends
the next call in a clear error, not a hang.

Tolerance: the sharded model sums each row-parallel layer's products in tp parts instead of one, a
reordering that moves fp32 logits by ~1e-5 of their size (tests/test_tp_model.py derives it). Greedy
tokens can therefore differ only where size 1's two best tokens are within that of each other; the
oracle compares every sequence up to its first step whose top-2 log-probability gap is under 1e-3
(two orders of magnitude above the reordering), and asserts that this cuts little.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from tiny_models import VOCAB, make_tiny

from minillm import LLM, SamplingParams
from minillm.cli import main as cli
from minillm.distributed import model_parallel_is_initialized, run_ranks
from minillm.loader import load_model
from minillm.quantize import parse_quantization

TIE = 1e-3
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=48, block_size=4,
              num_gpu_blocks=24, enable_prefix_caching=True)


def _prompts(seed: int) -> list[dict]:
    """Random ids; two share a 20-token prefix (prefix caching), one is longer than the token budget
    (a chunked prompt)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    lens = [rng.randint(3, 12) for _ in range(3)] + [60]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(4)], shared + [rng.randrange(VOCAB) for _ in range(7)]]
    prompts += [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]
    return [{"prompt_token_ids": p} for p in prompts]


def _greedy(llm, prompts, n: int, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _until_tie(out, tie: float = TIE) -> int:
    """How many of a size-1 output's tokens are decided by more than `tie` (its first near-tie ends it)."""
    for i, step in enumerate(out.logprobs):
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < tie:
            return i
    return len(out.token_ids)


def assert_tokens_until_ties(want, got, steps: int) -> None:
    """Each sequence's tokens equal up to size 1's first near-tie, and the ties cut at most half."""
    compared = 0
    for w, g in zip(want, got):
        k = _until_tie(w)
        assert g.token_ids[:k] == w.token_ids[:k]
        compared += k
    assert compared >= len(want) * steps // 2, "too many near-ties to compare: the test proves too little"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 2 KV heads, biases, an untied head, and 3 rows past the tokenizer (a padded vocabulary: an odd split)
    return make_tiny("llama3", tmp_path_factory.mktemp("tp-engine"), vocab_size=VOCAB + 3)


@pytest.mark.parametrize("async_scheduling", [False, True])  # True: the last step's tokens go to rank 1 too
@pytest.mark.slow
def test_tp2_engine_makes_the_tokens_of_tp1(tiny, async_scheduling):
    prompts, steps = _prompts(random.randrange(1 << 30)), 24
    with LLM(tiny, **ENGINE) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    assert not model_parallel_is_initialized()
    # 24 blocks of 4 tokens: the longest sequence (60 + 24 tokens) fits alone, four running ones do not
    with LLM(tiny, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE) as llm:
        got = _greedy(llm, prompts, steps)
        alone = [_greedy(llm, [p], steps)[0] for p in prompts[:2]]  # the engine oracle: batched = alone
        stats = llm.engine.engine_stats  # the runs alone find their prompts' blocks cached
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, "the run must exercise both"
    assert_tokens_until_ties(want, got, steps)
    assert [a.token_ids for a in alone] == [g.token_ids for g in got[:2]]
    assert not model_parallel_is_initialized(), "shutdown leaves the group"


def _int8_shards(rank: int, world_size: int, folder) -> list:
    """This rank's int8 weights and scales of every row-parallel layer of block 0."""
    model = load_model(folder, quantization="int8", tokenizer=False)[0]
    block = model.model.layers[0]
    return [(m.qweight, m.scales) for m in (block.self_attn.o_proj, block.mlp.down_proj)]


@pytest.mark.slow
def test_int8_row_parallel_shards_are_the_slices_of_tp1s_int8_weights(tiny):
    """The scale of a row comes from the whole row: an all-reduce of the ranks' maxima. Each rank's
    int8 weights are then exactly TP = 1's, sliced by input features, with TP = 1's scales."""
    model = load_model(tiny, quantization="int8", tokenizer=False)[0]
    block = model.model.layers[0]
    whole = [(m.qweight, m.scales) for m in (block.self_attn.o_proj, block.mlp.down_proj)]
    per_rank = run_ranks(_int8_shards, 2, tiny)
    for layer, (q, scales) in enumerate(whole):
        k = q.shape[1] // 2
        for rank, shards in enumerate(per_rank):
            q_r, s_r = shards[layer]
            assert torch.equal(s_r, scales)
            assert torch.equal(q_r, q[:, rank * k:(rank + 1) * k])


@pytest.mark.slow
def test_int8_at_tp2_makes_the_tokens_of_int8_at_tp1(tiny):
    """Quantized on the fly after sharding: a row-parallel rank's int8 scales come from the whole row
    (an all-reduce of the ranks' maxima), so each rank holds TP = 1's int8 weights, sliced."""
    prompts, steps = _prompts(random.randrange(1 << 30))[:3], 12
    with LLM(tiny, quantization="int8", device="cpu", dtype="float32") as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    with LLM(tiny, quantization="int8", device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        got = _greedy(llm, prompts, steps)
    compared = 0
    for w, g in zip(want, got):
        k = _until_tie(w)
        assert g.token_ids[:k] == w.token_ids[:k]
        compared += k
    assert compared >= len(want) * steps // 2


@pytest.mark.slow
def test_the_embedded_model_at_tp3_makes_the_tokens_of_tp1():
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    with LLM(device="cpu", dtype="float32") as ref:
        want = _greedy(ref, prompts, 16, logprobs=2)
    with LLM(device="cpu", dtype="float32", tensor_parallel_size=3) as llm:
        got = _greedy(llm, prompts, 16)
    for w, g in zip(want, got):
        k = _until_tie(w)
        assert k >= 8 and g.token_ids[:k] == w.token_ids[:k]


def test_a_dead_worker_ends_in_a_clear_error_not_a_hang(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, **ENGINE)
    try:
        assert len(_greedy(llm, _prompts(1)[:2], 4)) == 2
        proc = llm.engine.executor.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            _greedy(llm, _prompts(2)[:2], 4)
        with pytest.raises(RuntimeError, match="rank 1 exited|failed earlier"):  # and it stays failed
            _greedy(llm, _prompts(3)[:1], 4)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert not model_parallel_is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_ngram_drafts_at_tp_make_the_tokens_of_tp1(tmp_path, tp):
    """Issue 42 item 6: speculative decoding under tensor parallelism (n-gram drafts, looked up on rank 0;
    the verify step is an ordinary sharded forward pass with k + 1 logits rows per sequence)."""
    model = make_tiny("llama3", tmp_path / "six-heads", num_attention_heads=6, num_key_value_heads=6,
                      hidden_size=96, intermediate_size=96)
    rng = random.Random(random.randrange(1 << 30))
    loop = [rng.randrange(VOCAB) for _ in range(5)]  # repeated: the drafter finds what to propose
    prompts = [{"prompt_token_ids": loop * 4 + [rng.randrange(VOCAB) for _ in range(n)]} for n in (1, 3, 6)]
    steps = 16
    with LLM(model, **ENGINE) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(model, tensor_parallel_size=tp, speculative_config=spec, **ENGINE) as llm:
        got = _greedy(llm, prompts, steps)
        metrics = llm.engine.engine_stats.spec
    assert metrics.num_draft_tokens > 0 and metrics.num_accepted_tokens > 0, metrics
    assert_tokens_until_ties(want, got, steps)
    assert not model_parallel_is_initialized()


@pytest.mark.slow
def test_engines_of_different_sizes_come_and_go_in_one_process(tmp_path):
    """Issue 50: four engines in one process (TP 2, 3, 1, 2), each ended a different way (shutdown(),
    `with`, `del` and garbage collection, `del` alone): each starts, makes the TP=1 tokens and leaves
    the group, so the next one may take any size. Before the fix the executor's atexit hook kept a
    deleted engine's group alive and the next start was refused."""
    import gc

    model = make_tiny("llama3", tmp_path / "six-heads", num_attention_heads=6, num_key_value_heads=6,
                      hidden_size=96, intermediate_size=96)  # 6 heads, 96 features: sizes 1, 2 and 3 divide them
    prompts, steps = _prompts(random.randrange(1 << 30))[:3], 8
    with LLM(model, **ENGINE) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    for tp, ending in [(2, "shutdown"), (3, "with"), (1, "del+gc"), (2, "del")]:
        start = time.monotonic()
        if ending == "with":
            with LLM(model, tensor_parallel_size=tp, **ENGINE) as llm:
                got = _greedy(llm, prompts, steps)
        else:
            llm = LLM(model, tensor_parallel_size=tp, **ENGINE)
            got = _greedy(llm, prompts, steps)
            procs = getattr(llm.engine.executor, "procs", [])
            if ending == "shutdown":
                llm.shutdown()
            del llm
            if ending == "del+gc":
                gc.collect()
            assert all(p.poll() is not None for p in procs), f"TP={tp} ended by {ending}: its ranks still run"
        assert_tokens_until_ties(want, got, steps)
        assert not model_parallel_is_initialized(), f"TP={tp} ended by {ending} left its group behind"
        assert time.monotonic() - start < 120, f"TP={tp} took {time.monotonic() - start:.0f} s"


def test_a_second_live_tp_engine_is_refused_clearly(tiny):
    """One tensor-parallel group per process: a second engine while the first lives is refused at once,
    naming what to do, and the first keeps working."""
    with LLM(tiny, tensor_parallel_size=2, **ENGINE) as first:
        with pytest.raises(RuntimeError, match="already running in this process"):
            LLM(tiny, tensor_parallel_size=2, **ENGINE)
        assert len(_greedy(first, _prompts(4)[:1], 3)[0].token_ids) == 3
    assert not model_parallel_is_initialized()


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, enable_kv_cache=False), "needs the engine"),
    (dict(tensor_parallel_size=2, kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2,
                                                       "num_draft_layers": 1}), "drafts only with method 'ngram'"),
    (dict(tensor_parallel_size=2, quantization="awq"), "calibrates each whole layer"),
    (dict(tensor_parallel_size=2, quantization={"method": "gptq", "group_size": 32}), "calibrates each whole layer"),
    (dict(tensor_parallel_size=2, quantization="gguf"), "gguf|GGUF|one GPU"),
])
def test_settings_tp_cannot_run_fail_before_any_process_starts(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny, device="cpu", dtype="float32", **kwargs)
    assert not model_parallel_is_initialized()


@pytest.mark.parametrize("family, method, changes", [
    ("llama3", "int8", dict(vocab_size=VOCAB + 3)),  # q/k/v and gate/up stacked, biases, 2 KV heads
    ("qwen2", "int4", dict(intermediate_size=128)),  # 1 KV head, replicated on both ranks; groups of 32
])
def test_a_saved_quantized_folder_at_tp2_makes_the_tokens_of_tp1(family, method, changes, tmp_path):
    """A folder `minillm quantize` wrote holds whole (TP = 1) packed tensors; each rank takes its part
    as its layers' loaders cut a checkpoint (layers/quantization/saved.py rank_part), so the two
    sizes run the same quantized weights."""
    model = make_tiny(family, tmp_path / family, **changes)
    out = tmp_path / method
    flags = ["--group-size", "32"] if method == "int4" else []
    assert cli(["quantize", "--model", str(model), "--method", method, *flags, "--out", str(out),
                "--device", "cpu"]) == 0
    prompts, steps = _prompts(random.randrange(1 << 30))[:4], 12
    args = dict(device="cpu", dtype="float32", quantization=parse_quantization(str(out)))
    with LLM(model, **args) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    with LLM(model, tensor_parallel_size=2, **args) as llm:
        got = _greedy(llm, prompts, steps)
    assert_tokens_until_ties(want, got, steps)


def test_a_size_the_heads_do_not_divide_fails_clearly_and_stops_the_workers(tiny):
    with pytest.raises(ValueError, match="divis|divide"):
        LLM(tiny, device="cpu", dtype="float32", tensor_parallel_size=3)  # 4 heads, 2 KV heads
    assert not model_parallel_is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_on_two_gpus_with_cuda_graphs_makes_the_tokens_of_tp1(tiny, dtype):
    """Issue 28's native run: NCCL, one GPU per rank, CUDA graphs and overlap scheduling on (the
    defaults), the same kernels at both sizes. bf16 rounds each partial sum before the all-reduce adds
    them, so its near-tie threshold is bf16's: 2^-8 relative on logits of size ~1 -> 1e-2."""
    prompts, steps = _prompts(random.randrange(1 << 30)), 24
    engine = dict(ENGINE, device="cuda", dtype=dtype, num_gpu_blocks=None)
    tie = TIE if dtype == "float32" else 1e-2
    with LLM(tiny, **engine) as ref:
        want = _greedy(ref, prompts, steps, logprobs=2)
    with LLM(tiny, tensor_parallel_size=2, **engine) as llm:
        assert llm.engine.executor.worker.runner.graphs is not None, "CUDA graphs must be on"
        got = _greedy(llm, prompts, steps)
        alone = [_greedy(llm, [p], steps)[0] for p in prompts[:2]]
    compared = 0
    for w, g in zip(want, got):
        k = _until_tie(w, tie)
        assert g.token_ids[:k] == w.token_ids[:k]
        compared += k
    assert compared >= len(want) * steps // 2
    assert [a.token_ids for a in alone] == [g.token_ids for g in got[:2]]
