"""Chapter 03: the KV cache changes how much work a step does, never its result.

Oracle: the full recompute of chapter 02 (every step runs the whole sequence again). For random
configs and the embedded model, logits with the cache match it at every step and greedy tokens are
identical; the cache's memory is chapter 00's formula.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_model

from minillm import LLM, SamplingParams
from minillm.cache import KVCache, KVCacheSpec
from minillm.config import ModelConfig
from minillm.generation import prepare_inputs
from minillm.kv_memory import kv_bytes_per_token
from minillm.layers.backend import kernel_mode


def step_both_ways(model, prompts: list[list[int]], steps: int, rng: random.Random):
    """Teacher-forced: feed both paths the recompute's greedy tokens; yield (cached, recomputed)
    last-token logits of every sequence at every step."""
    config = model.config
    cache = KVCache.for_model(config, len(prompts) + 2, max(map(len, prompts)) + steps, torch.float32, "cpu")
    cache.bind(model)
    slots = [cache.allocate() for _ in range(cache.num_slots)]
    rng.shuffle(slots)  # sequences need not sit in slot order
    seqs = [SimpleNamespace(token_ids=list(p)) for p in prompts]
    computed = [0] * len(seqs)
    for _ in range(steps):
        ids, pos, meta = prepare_inputs(seqs, slots[: len(seqs)], computed, cache, "cpu")
        cached = model.compute_logits(model(ids, pos, meta)[meta.last_token_indices])  # [B, vocab]
        ids, pos, meta = prepare_inputs(seqs, slots[: len(seqs)], computed, None, "cpu")
        full = model.compute_logits(model(ids, pos, meta)[meta.last_token_indices])
        yield cached, full
        computed = [len(s.token_ids) for s in seqs]
        for s, t in zip(seqs, full.argmax(-1).tolist()):
            s.token_ids.append(t)
    cache.unbind(model)


@pytest.mark.parametrize("trial", range(4))
@torch.inference_mode()
def test_cached_logits_match_recompute_at_every_step(seed, trial):
    rng = random.Random(seed + trial)
    model, config = random_model(rng)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
    argmax_same = 0
    for cached, full in step_both_ways(model, prompts, steps=10, rng=rng):
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
        argmax_same += int(torch.equal(cached.argmax(-1), full.argmax(-1)))
    assert argmax_same == 10, f"config {config}"


@torch.inference_mode()
def test_cache_is_actually_read(seed):
    """Corrupt the cached K of an early position: the next decode step's logits must change
    (a cache that is written but never read would pass the test above)."""
    rng = random.Random(seed)
    model, _ = random_model(rng, sliding_windows=[], architecture="llama")
    steps = step_both_ways(model, [[rng.randrange(97) for _ in range(6)]], steps=3, rng=rng)
    next(steps)  # prefill
    layer = next(m for m in model.modules() if getattr(m, "kv_cache", None) is not None)
    layer.kv_cache[0].mul_(-1.0)  # every cached key of layer 0, negated
    cached, full = next(steps)
    assert (cached - full).abs().max() > 1e-3


@pytest.mark.slow
def test_greedy_tokens_identical_with_and_without_cache_embedded_model():
    llm = LLM(dtype="float32")  # the GPU if there is one
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_cache = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    llm.enable_kv_cache = False
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert with_cache == without
    # n > 1 seeded sampling: every completion the same both ways too
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_tokens=8, seed=7)
    without = [c.token_ids for c in llm.generate(prompts[0], sampled)[0].outputs]
    llm.enable_kv_cache = True
    assert [c.token_ids for c in llm.generate(prompts[0], sampled)[0].outputs] == without


@pytest.mark.slow
def test_switching_the_cache_off_leaves_the_engine_alone(monkeypatch):
    """enable_kv_cache=False on an LLM built with the engine runs chapter 02's loop: the engine is not
    stepped (a flag that changed nothing made the test above compare the engine with itself)."""
    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.enable_kv_cache = False

    def refuse(*_, **__):
        raise AssertionError("the engine ran with enable_kv_cache=False")
    monkeypatch.setattr(llm.engine, "step", refuse)
    assert len(llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert "".join(llm.stream("Hello", greedy))
    with pytest.raises(TypeError, match="enable_kv_cache"):
        llm.enable_kv_cache = 1
    bare = LLM(dtype="float32", device="cpu", enable_kv_cache=False)
    with pytest.raises(ValueError, match="needs an engine"):
        bare.enable_kv_cache = True


def test_cache_memory_is_chapter_00_formula():
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache.for_model(config, num_slots=5, max_len=40, dtype=dtype, device="cpu")
        per_token = kv_bytes_per_token(3, 2, 16, dtype_bytes=torch.empty((), dtype=dtype).element_size())
        assert cache.bytes_per_token == per_token
        assert cache.nbytes == per_token * 5 * 40  # every slot reserved for max_len tokens


def test_slots_and_errors():
    cache = KVCache([KVCacheSpec(1, 8, torch.float32)], num_slots=2, max_len=4, device="cpu")
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.allocate()
    cache.free(a)
    with pytest.raises(ValueError, match="not an allocated slot"):
        cache.free(a)
    assert cache.slot_mapping(b, 1, 3) == [b * 4 + 1, b * 4 + 2]
    with pytest.raises(ValueError, match="max_len 4"):
        cache.slot_mapping(b, 2, 5)
    with pytest.raises(ValueError, match="num_slots"):
        KVCache([KVCacheSpec(1, 8, torch.float32)], num_slots=0, max_len=4, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@torch.inference_mode()
def test_triton_path_matches_torch_path_under_the_interpreter(seed, family, tok):
    """The whole engine through minillm's Triton kernels (interpreted on a CPU) gives the PyTorch
    path's greedy tokens: prefill, cached decode and the fused small kernels together."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
    rng = random.Random(seed)
    model, config = random_model(rng, architecture=family, num_layers=2,
                                 sliding_windows=[4, None] if family == "mistral" else [])
    if torch.cuda.is_available():
        model = model.cuda()
    from minillm.generation import generate_sequences

    prompt = [rng.randrange(config.vocab_size) for _ in range(9)]
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for mode in ("torch", "triton"):
        with kernel_mode(mode):
            *_, seqs = generate_sequences(model, tok, prompt, params, [])
        runs[mode] = [s.output_ids for s in seqs]
    assert runs["triton"] == runs["torch"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU machine)")
def test_embedded_model_same_greedy_text_through_triton_kernels_on_gpu():
    """On a GPU the engine runs minillm's Triton kernels: the same greedy tokens as the PyTorch
    references (fp32, prefill + cached decode, n=2 packed); bf16 logits close."""
    llm = LLM(dtype="float32", device="cuda")
    prompts = ["The capital of France is", "Write a short poem about the sea."]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for mode in ("triton", "torch"):
        with kernel_mode(mode):
            runs[mode] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy)]
    assert runs["triton"] == runs["torch"]
    # bf16: no two orders of summation agree exactly, so hold the kernels to the PyTorch path's own
    # bf16 error: both measured against the fp32 logits, the kernels may be at most 1.5x as far off.
    ids = llm.tokenizer.encode(prompts[1])
    args = prepare_inputs([SimpleNamespace(token_ids=ids)], [0], [0], None, "cuda")
    with torch.inference_mode(), kernel_mode("torch"):
        exact = llm.model.compute_logits(llm.model(*args))  # [T, vocab] fp32
    # a small fixed pool: the fp32 engine above still holds its share of the GPU in this process
    llm16 = LLM(dtype="bfloat16", device="cuda", num_gpu_blocks=64)
    err = {}
    for mode in ("triton", "torch"):
        with torch.inference_mode(), kernel_mode(mode):
            err[mode] = (llm16.model.compute_logits(llm16.model(*args)) - exact).abs().mean().item()
    assert err["triton"] <= 1.5 * err["torch"], err
