"""Chapter 07's engine-level oracle: batching, paging, chunking, preemption and prefix reuse change
when a request's tokens are computed, never which tokens it gets.

For random models and random mixes of requests (shared prefixes, greedy and seeded sampling, n > 1,
stop tokens, aborts mid-flight), the tokens of every completion through LLMEngine equal the tokens
the same request gets alone through chapter 03's one-request path. The pool is tiny, so sequences
are preempted (recompute and swap); the token budget is small, so prompts are chunked.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.generation import generate_sequences
from minillm.worker.cuda_graphs import cuda_graph_sizes, token_buckets


def random_requests(rng: random.Random, vocab: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    system = [rng.randrange(vocab) for _ in range(rng.randrange(0, 28))]  # a shared "system prompt"
    out = []
    for _ in range(count):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        prompt = (system if rng.random() < 0.6 else []) + own
        kind = rng.choice(["greedy", "greedy", "seeded"])
        params = SamplingParams(
            max_tokens=rng.randrange(1, 20), n=rng.choice([1, 1, 1, 2, 3]),
            temperature=0.0 if kind == "greedy" else 0.9, top_p=rng.choice([1.0, 0.8]),
            seed=None if kind == "greedy" else rng.randrange(1 << 30),
            stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else [])
        out.append((prompt, params))
    return out


def alone(model, tok, prompt, params, eos=()) -> list[list[int]]:
    *_, seqs = generate_sequences(model, tok, prompt, params, list(eos))
    return [s.output_ids for s in seqs]


def pad_steps_eagerly(engine: LLMEngine) -> None:
    """On a CPU: run the CUDA-graph path's padded static buffers eagerly (no capture), so the padding
    is held to the same oracle as everything else."""
    engine.runner.graphs = engine.runner.make_graphs(capture=False)


def replayed_both_kinds(engine: LLMEngine) -> bool:
    """A decode-batch graph and a graph of a step with prompt tokens were both replayed (not just captured)."""
    return {shape.max_seqlen == 1 for shape in engine.runner.graphs.replays} == {True, False}


def blocks_for(requests, block_size: int) -> int:
    return max(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in requests)


def random_engine_config(rng: random.Random, requests, case: int, **overrides) -> EngineConfig:
    """A small pool (preemption by recompute or swap), a small token budget (chunked prompts), prefix
    caching of either kind: the configurations the engine oracles draw from."""
    block_size = rng.choice([1, 4, 16])
    return EngineConfig(block_size=block_size,
                        num_gpu_blocks=blocks_for(requests, block_size) + 1 + rng.randrange(0, 8),
                        num_cpu_blocks=rng.choice([0, 64]), preemption_mode=["recompute", "swap"][case % 2],
                        enable_prefix_caching=[None, "hash", "radix"][case % 3],
                        max_num_batched_tokens=rng.randrange(4, 40), max_num_seqs=rng.randrange(3, 9),  # n <= 3
                        **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(6))
def test_engine_matches_one_request_at_a_time(seed, tok, case):
    rng = random.Random(seed * 100 + case)
    model, config = random_model(rng)
    requests = random_requests(rng, config.vocab_size, rng.randrange(4, 12))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    ec = random_engine_config(rng, requests, case)
    engine = LLMEngine(model, tok, [], ec)
    padded = case >= 3 and engine.runner.graphs is None
    if padded:
        pad_steps_eagerly(engine)
    aborted = {f"r{i}" for i in range(len(requests)) if rng.random() < 0.15}
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, priority=rng.choice([0, 0, 1]))
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = [c.token_ids for c in out.outputs]
        steps += 1
        if steps == 3:
            engine.abort_request(sorted(aborted) + ["no-such-request"])
    for i, want in enumerate(expected):
        rid = f"r{i}"
        if rid in aborted:  # stopped early: whatever it got is the start of its tokens
            for g, w in zip(got.get(rid, []), want):
                assert g == w[: len(g)], (rid, g, w)
            continue
        assert got[rid] == want, f"{rid}: engine {got[rid]} vs alone {want} ({ec})"
    bm = engine.block_manager
    assert not bm.block_tables and not bm.cpu_tables  # everything given back
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert sum(bm.ref_counts) == 0
    if padded:
        assert replayed_both_kinds(engine)


def test_pressure_preempts_and_both_modes_finish(seed, tok):
    """Four long requests, a pool that holds about one: preemption happens, nobody raises."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = [([rng.randrange(config.vocab_size) for _ in range(12)], SamplingParams(max_tokens=30, temperature=0))
                for _ in range(4)]
    want = [alone(model, tok, p, sp) for p, sp in requests]
    for mode in ("recompute", "swap"):
        # kv_eviction="none": a random model may slide on every layer, and freeing the blocks before its
        # window (the default, chapter 15) would leave no pressure to preempt under
        engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=14, num_cpu_blocks=40,
                                                        preemption_mode=mode, max_num_batched_tokens=64,
                                                        kv_eviction="none"))
        for i, (p, sp) in enumerate(requests):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
        assert [done[str(i)] for i in range(4)] == want
        assert engine.stats["num_preemptions"] > 0, mode


def test_a_swapped_sequence_that_needs_the_whole_pool_comes_back(seed, tok):
    """B is swapped out holding 3 of the pool's 4 blocks, one token before its 4th: once A is done the
    whole pool is free and B must come back (a spare-block margin in the swap-in check kept it out)."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    a = ([rng.randrange(config.vocab_size) for _ in range(4)], SamplingParams(max_tokens=12, temperature=0))
    b = ([rng.randrange(config.vocab_size) for _ in range(12)], SamplingParams(max_tokens=4, temperature=0))
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=5, num_cpu_blocks=8,
                                                    preemption_mode="swap", max_num_batched_tokens=32,
                                                    kv_eviction="none"))  # (a window would free blocks)
    for rid, (p, sp) in (("a", a), ("b", b)):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests() and steps < 100:
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        steps += 1
    assert engine.stats["num_preemptions"] == 1 and not engine.has_unfinished_requests(), steps
    assert [done["a"], done["b"]] == [alone(model, tok, *a)[0], alone(model, tok, *b)[0]]


def test_prefix_cache_hits_skip_work(seed, tok):
    rng = random.Random(seed)
    model, config = random_model(rng)
    system = [rng.randrange(config.vocab_size) for _ in range(40)]
    for kind in ("hash", "radix"):
        engine = LLMEngine(model, tok, [], EngineConfig(block_size=8, num_gpu_blocks=64, enable_prefix_caching=kind))
        outs = []
        for i in range(3):  # one after another: the second and third find the first's blocks
            prompt = system + [rng.randrange(config.vocab_size) for _ in range(5)]
            params = SamplingParams(max_tokens=4, temperature=0)
            outs.append(list(engine.stream(str(i), {"prompt_token_ids": prompt}, params))[-1])
            assert outs[-1].outputs[0].token_ids == alone(model, tok, prompt, params)[0]
        assert engine.stats["prefix_hit_tokens"] == 2 * 40  # 5 full blocks of 8, twice
    bad = EngineConfig(block_size=8, num_gpu_blocks=64)
    assert LLMEngine(model, tok, [], bad).stats["prefix_hit_rate"] is None


@pytest.mark.slow
def test_warm_up_runs_every_bucket_and_leaves_the_engine_as_it_was(seed, tok):
    rng = random.Random(seed)
    model, config = random_model(rng)
    kind = rng.choice([None, "hash", "radix"])
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, enable_prefix_caching=kind,
                                                    max_num_batched_tokens=40))
    with pytest.raises(ValueError, match="max_prompt_len"):
        engine.warm_up("16")
    seen, add = [], engine.add_request
    engine.add_request = lambda rid, prompt, params: (seen.append(len(prompt["prompt_token_ids"])),
                                                      add(rid, prompt, params))
    before = engine.stats
    assert engine.warm_up() >= 0
    assert seen == [1, 15, 16, 31, 32, 39, 40]  # buckets 16, 32, 64 (capped at the budget), each k and k - 1
    assert engine.stats == before and not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert not bm.block_tables and bm.num_free_blocks == bm.num_blocks - 1
    engine.add_request = add
    requests = random_requests(rng, config.vocab_size, 5)
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    with pytest.raises(ValueError, match="idle"):
        engine.warm_up()
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    assert [got[f"r{i}"] for i in range(5)] == [alone(model, tok, p, sp) for p, sp in requests]


@pytest.mark.slow
def test_forks_of_parallel_sampling_count_against_max_num_seqs(seed, tok):
    """A request with n > 1 becomes n sequences once its prompt is computed: admission reserves them,
    so the running set never exceeds max_num_seqs, and every completion is still its own."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(n=rng.choice([1, 2, 3]), max_tokens=rng.randrange(1, 12), temperature=0.8,
                                seed=rng.randrange(1 << 30)))
                for _ in range(8)]
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=200, max_num_seqs=3,
                                                    max_num_batched_tokens=rng.randrange(4, 24)))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("too-many", {"prompt_token_ids": [1, 2]}, SamplingParams(n=4))
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got, most = {}, 0
    while engine.has_unfinished_requests():
        got |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
        most = max(most, len(engine.scheduler.running))
    assert most <= 3
    assert [got[f"r{i}"] for i in range(8)] == [alone(model, tok, p, sp) for p, sp in requests]


def test_bad_requests_are_refused_and_others_still_run(seed, tok):
    rng = random.Random(seed)
    model, config = random_model(rng)
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=6))  # 5 usable blocks = 20 tokens
    engine.add_request("ok", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("huge", {"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", {"prompt_token_ids": [1] * 300}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("vocab", {"prompt_token_ids": [config.vocab_size]}, SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("params", {"prompt_token_ids": [1]}, {"max_tokens": 3})
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", {"prompt_token_ids": [1]}, SamplingParams())
    engine.abort_request("never-added")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "ok" and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    engine.abort_request("ok")  # finished already: harmless


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 0, "block_size"), ("preemption_mode", "drop", "preemption_mode"),
    ("enable_prefix_caching", "trie", "enable_prefix_caching"), ("gpu_memory_utilization", 1.5, "gpu_memory"),
    ("num_gpu_blocks", 1, "num_gpu_blocks"), ("max_num_seqs", -1, "max_num_seqs")])
def test_engine_config_names_the_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("max_num_seqs,cap", [(24, 256), (256, 256), (5, 256), (1, 256), (300, 40), (16, 16)])
def test_cuda_graphs_cover_every_batch_the_scheduler_can_form(max_num_seqs, cap):
    """Every decode batch b <= min(max_num_seqs, cap) has a captured size >= b that is no bigger than
    needed: with max_num_seqs = 24 a batch of 17-24 used to run eagerly (sizes stopped at 16)."""
    sizes = cuda_graph_sizes(max_num_seqs, cap)
    top = min(max_num_seqs, cap)
    assert sizes == sorted(set(sizes)) and sizes[-1] == top and sizes[0] == 1
    for b in range(1, top + 1):
        pad = next(s for s in sizes if s >= b)
        assert pad - b < max(b, 16), (b, pad)  # padding never doubles a batch beyond 16 rows


# Padding rows hold whatever the attention output's fresh memory held (nothing reads them, see
# minillm/worker/cuda_graphs.py); the interpreter's numpy may warn when that garbage overflows.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_padded_steps_through_the_triton_kernels(seed, tok):
    """The CUDA-graph path's padding through minillm's Triton kernels (the interpreter on a CPU, the
    native kernels on a GPU machine): padding sequences with no tokens, an attention grid sized for the
    whole bucket, padding decode rows reading block 0. Every request still gets its one-request tokens."""
    import os

    from minillm.layers.backend import kernel_mode

    rng = random.Random(seed)
    model, config = random_model(rng)
    if os.environ.get("TRITON_INTERPRET") != "1":  # no interpreter: CPU tensors cannot run the kernels
        model = model.to("cuda")
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 30))],
                 SamplingParams(max_tokens=rng.randrange(2, 8), temperature=0.0)) for _ in range(4)]
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24,
                                                    max_num_seqs=3))
    pad_steps_eagerly(engine)
    with kernel_mode("triton"):
        for i, (p, sp) in enumerate(requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        got = {}
        while engine.has_unfinished_requests():
            got |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    assert [got[f"r{i}"] for i in range(len(requests))] == expected
    assert replayed_both_kinds(engine)


def test_warm_up_captures_every_token_bucket(seed, tok):
    """Steps mixing several prompts can fill the whole budget: warm_up captures every bucket up to it,
    even with short warm-up prompts, so nothing is captured while serving."""
    model, _ = random_model(random.Random(seed))
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=80,
                                                    max_num_seqs=4))
    pad_steps_eagerly(engine)
    engine.warm_up(max_prompt_len=8)
    captured = {shape.tokens for shape in engine.runner.graphs.steps if shape.max_seqlen > 1}
    assert captured == set(token_buckets(80)) == {16, 32, 64, 80}


@pytest.mark.parametrize("max_tokens", [1, 4, 20, 40, 512, 600, 2048, 8192])
def test_token_buckets_cover_every_step_size(max_tokens):
    """Every step of 1..max_tokens tokens has a bucket: at most 16 tokens or twice the step, and never
    512 tokens of padding."""
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for t in range(1, max_tokens + 1):
        pad = next(b for b in buckets if b >= t)
        assert pad <= max(16, 2 * t - 1) and pad - t < 512, (t, pad)
    assert token_buckets(0) == []


@pytest.mark.slow
def test_llm_generate_runs_through_the_engine(tok):
    """The embedded model, batched through the engine, gives each request its one-at-a-time tokens."""
    from minillm import LLM

    llm = LLM(dtype="float32", device="cpu", max_num_batched_tokens=24, block_size=8)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    params = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=6, temperature=0, n=2),
              SamplingParams(max_tokens=9, temperature=0.8, seed=7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        want = alone(llm.model, llm.tokenizer, llm.tokenizer.encode(prompt), sp, llm.eos_token_ids)
        assert [c.token_ids for c in out.outputs] == want
        assert out.prompt == prompt and out.finished
    assert torch.is_grad_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_embedded_model_on_gpu_with_and_without_cuda_graphs(seed, enforce_eager):
    """Triton kernels on the GPU, decode from CUDA graphs (or eager): every request's tokens are its
    one-request tokens, with chunking, a pool small enough to preempt, and n > 1. fp32, because in bf16
    a different batch shape may pick a different GEMM kernel, and random prompts have near-ties that
    its rounding can flip (notebook 07 shows bf16 on real prompts)."""
    from minillm import LLM

    rng = random.Random(seed)
    llm = LLM(dtype="float32", enforce_eager=enforce_eager, num_gpu_blocks=40, block_size=16, max_num_batched_tokens=64,
              preemption_mode=rng.choice(["recompute", "swap"]), num_cpu_blocks=64, cuda_graph_max_batch=16)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(5, 120))]}
               for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randrange(8, 48), n=rng.choice([1, 2]), ignore_eos=True,
                             temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(1 << 30)) for _ in prompts]
    llm.engine.warm_up()  # with graphs: every token bucket captured on dummy prompts, then replayed below
    if not enforce_eager:
        llm.engine.runner.graphs.replays.clear()  # count only what generate replays
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        want = alone(llm.model, llm.tokenizer, prompt["prompt_token_ids"], sp, llm.eos_token_ids)
        assert [c.token_ids for c in out.outputs] == want
    assert enforce_eager or replayed_both_kinds(llm.engine)
