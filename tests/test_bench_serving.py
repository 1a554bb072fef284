"""The serving benchmarks (`minillm bench throughput|latency`) on a CPU with tiny models: every field
is there, the ratios are the engine's and the peer's own numbers divided, every request got exactly
its output length (also through preemptions), and bad arguments are clear ValueErrors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from minillm.bench import serving
from minillm.bench.serving_setup import random_requests
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine

TINY = ModelConfig(architecture="qwen3", vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, qk_norm=True,
                   tie_word_embeddings=True, name="tiny-qwen3")
SIZES = dict(min_input_len=4, max_input_len=16, min_output_len=3, max_output_len=12)



@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine their spin-waits cost
    milliseconds per matmul; one thread keeps these tests to seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


MINILLM_KEYS = {"engine", "num_requests", "elapsed_s", "output_tokens", "prompt_tokens", "output_tok_s",
                "total_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
                "itl_p99_ms", "peak_used_blocks", "num_blocks", "num_preemptions", "useful_pct"}
HF_KEYS = {"engine", "elapsed_s", "num_requests", "num_batches", "batch_size", "output_tokens", "prompt_tokens",
           "generated_tokens", "padded_prompt_tokens", "output_tok_s", "total_tok_s", "useful_pct"}
LATENCY_KEYS = {"engine", "decode_tok_s", "ttft_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_ms", "floor_tok_s",
                "pct_of_floor"}


def test_throughput_counts_preemptions(seed):
    """Whether random lengths overflow the pool depends on the draw; these cannot fit: six 1-block
    prompts all start (6 of the 7 usable blocks), and each grows to 16 tokens = 4 blocks."""
    res = serving.throughput(TINY, num_requests=6, min_input_len=4, max_input_len=4, min_output_len=12,
                             max_output_len=12, seed=seed, hf=False, device="cpu", progress=False, block_size=4,
                             num_gpu_blocks=8, max_num_batched_tokens=32)
    ours = res["minillm"]
    assert ours["num_preemptions"] > 0 and ours["peak_used_blocks"] <= 7
    assert ours["output_tokens"] == 6 * 12 and all(r["generated"] == 12 for r in res["requests"])


def test_throughput_counts_and_ratio(seed, tmp_path, capsys):
    n, hf_n, batch = 6, 5, 2
    # a pool of 8 blocks of 4 tokens (7 usable) for requests of up to 28 tokens: the engine must preempt
    res = serving.throughput(TINY, num_requests=n, **SIZES, seed=seed, hf_batch_size=batch, hf_requests=hf_n,
                             device="cpu", progress=False, json_path=tmp_path / "t.json", block_size=4,
                             num_gpu_blocks=8, max_num_batched_tokens=32)
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(res))  # JSON-ready as returned
    ours, peer = res["minillm"], res["hf"]
    assert MINILLM_KEYS <= ours.keys() and HF_KEYS <= peer.keys()
    assert {"header", "ceilings", "requests", "engine_config", "ratio", "hf_requests"} <= res.keys()
    assert res["ratio"] == pytest.approx(ours["output_tok_s"] / peer["output_tok_s"])

    want = random_requests(random.Random(seed), n, (4, 16), (3, 12), TINY.vocab_size)  # the same draw
    assert [(r["prompt_len"], r["output_len"]) for r in res["requests"]] == [(len(p), o) for p, o in want]
    assert all(r["generated"] == r["output_len"] for r in res["requests"])
    assert ours["output_tokens"] == sum(o for _, o in want)
    assert ours["output_tok_s"] == pytest.approx(ours["output_tokens"] / ours["elapsed_s"])
    assert ours["peak_used_blocks"] <= 7  # block 0 is never handed out (preemption: the next test)

    # HF: only the first hf_n requests; every row of a batch runs to the batch's longest output
    sub = want[:hf_n]
    assert peer["num_requests"] == hf_n and peer["output_tokens"] == sum(o for _, o in sub)
    batches = [sub[i : i + batch] for i in range(0, hf_n, batch)]
    assert peer["generated_tokens"] == sum(len(b) * max(o for _, o in b) for b in batches)
    assert peer["useful_pct"] == pytest.approx(100 * peer["output_tokens"] / peer["generated_tokens"])
    out = capsys.readouterr().out
    assert f"first {hf_n} of {n} requests" in out and "measured ceilings" in out and "transformers" in out


def test_hf_peer_is_warmed_with_a_whole_batch_outside_the_clock(monkeypatch):
    calls = []
    real = serving.hf_peer.static_batches

    def spy(hf, requests, batch_size, device, progress=True, desc=None):
        calls.append((len(requests), batch_size, desc))
        return real(hf, requests, batch_size, device, progress=progress, desc=desc)

    monkeypatch.setattr(serving.hf_peer, "static_batches", spy)
    res = serving.throughput(TINY, num_requests=5, **SIZES, hf_batch_size=2, device="cpu", progress=False)
    assert calls == [(2, 2, "HF generate, warm-up batch"), (5, 2, None)]  # the warm-up first, then the timed run
    assert res["hf"]["num_requests"] == 5 and res["hf"]["num_batches"] == 3  # the warm-up is not counted


def test_throughput_without_peer():
    res = serving.throughput(TINY, num_requests=2, **SIZES, hf=False, device="cpu", progress=False)
    assert res["hf"] is None and res["ratio"] is None and res["hf_requests"] is None
    assert all(r["generated"] == r["output_len"] for r in res["requests"])


def test_throughput_steps_the_engine_as_llm_generate_does(monkeypatch):
    # An offline benchmark: every step returns only the finished requests (LLM.generate's stepping), not
    # a streaming caller's output for every running request; the progress bar still counts every token.
    calls, updates, real_step = [], [], serving.LLMEngine.step

    def step(self, *args, **kwargs):
        calls.append(kwargs.get("unfinished_outputs", args[0] if args else True))
        return real_step(self, *args, **kwargs)

    class Bar:
        def __init__(self, total, **kw):
            self.total = total

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            updates.append(n)

    monkeypatch.setattr(serving.LLMEngine, "step", step)
    monkeypatch.setattr("tqdm.auto.tqdm", Bar)
    res = serving.throughput(TINY, num_requests=3, **SIZES, hf=False, device="cpu", progress=True)
    assert calls and not any(calls)
    assert sum(updates) == sum(r["output_len"] for r in res["requests"])


def test_latency_fields_ratio_and_floor(seed):
    res = serving.latency(TINY, input_len=8, output_len=6, num_iters=2, seed=seed, device="cpu", progress=False)
    ours, peer = res["minillm"], res["hf"]
    assert LATENCY_KEYS <= ours.keys() and LATENCY_KEYS <= peer.keys()
    assert res["ratio"] == pytest.approx(ours["decode_tok_s"] / peer["decode_tok_s"])
    assert res["ttft_ratio"] == pytest.approx(peer["ttft_ms"] / ours["ttft_ms"])
    for row in (ours, peer):  # % of floor = floor time / measured time = measured tok/s / floor tok/s
        assert row["pct_of_floor"] == pytest.approx(100 * row["decode_tok_s"] / row["floor_tok_s"])
        assert row["floor_tok_s"] == pytest.approx(5 / res["floor_s"])  # 5 decode steps after the first token
    # the floor's bytes: fp32 weights (tied embedding once) and 2 (K, V) x layers x kv heads x head_dim x 4 B
    model_bytes = 4 * TINY.num_params
    assert res["weight_bytes"] == model_bytes
    assert res["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_cli_latency_on_an_hf_folder(tmp_path, capsys):
    """The CLI's plumbing, on a real checkpoint that minillm and transformers both load."""
    from tiny_models import make_tiny

    from minillm.cli import main

    folder = make_tiny("llama2-tied", tmp_path / "m")
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(folder), "--input-len", "6", "--output-len", "4",
                 "--num-iters", "1", "--num-iters-warmup", "0", "--device", "cpu", "--block-size", "8",
                 "--cuda-graph-max-tokens", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["input_len"] == 6 and res["output_len"] == 4 and res["engine_config"]["block_size"] == 8
    assert res["engine_config"]["cuda_graph_max_tokens"] == 0
    assert res["ratio"] == pytest.approx(res["minillm"]["decode_tok_s"] / res["hf"]["decode_tok_s"])
    assert "pct_of_floor" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_requests=0), "num_requests must be a positive int"),
    (dict(min_input_len=20, max_input_len=10), "min_input_len (20) must be <= max_input_len (10)"),
    (dict(min_output_len=0), "min_output_len must be a positive int"),
    (dict(hf_requests=9, num_requests=4), "hf_requests (9) must be <= num_requests (4)"),
    (dict(hf_batch_size=0), "hf_batch_size must be a positive int"),
    (dict(max_input_len=200, max_output_len=100), "exceeds the model's context (256 tokens)"),
    (dict(no_such_knob=1), "unknown engine arguments ['no_such_knob']"),
])
def test_throughput_bad_arguments(kwargs, message):
    base = dict(num_requests=2, **SIZES)
    with pytest.raises(ValueError, match=None) as err:
        serving.throughput(TINY, **(base | kwargs), device="cpu", progress=False)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(output_len=1), "output_len must be >= 2"),
    (dict(input_len=0), "input_len must be a positive int"),
    (dict(num_iters=0), "num_iters must be a positive int"),
])
def test_latency_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as err:
        serving.latency(TINY, **(dict(input_len=4, output_len=4) | kwargs), device="cpu", progress=False)
    assert message in str(err.value)


def test_unknown_dummy_model_and_cli_error(capsys):
    from minillm.cli import main

    with pytest.raises(ValueError, match="dummy models: smollm2-135m-dummy, qwen3-0.6b-dummy"):
        serving.latency("qwen9-dummy", device="cpu")
    assert main(["bench", "throughput", "--num-requests", "0", "--device", "cpu"]) == 2
    assert "minillm: error: num_requests must be a positive int" in capsys.readouterr().err


def test_cpu_defaults_shrink_with_a_note(capsys):
    given = dict.fromkeys(serving.THROUGHPUT_SIZES) | {"num_requests": 3}
    sizes = serving._sizes(serving.THROUGHPUT_SIZES, given, torch.device("cpu"))
    assert sizes["num_requests"] == 3 and sizes["max_input_len"] == serving.THROUGHPUT_SIZES["max_input_len"][1]
    note = capsys.readouterr().out
    assert "note: on a CPU the default sizes shrink" in note and "num_requests=" not in note
    gpu = serving._sizes(serving.THROUGHPUT_SIZES, dict.fromkeys(serving.THROUGHPUT_SIZES), torch.device("cuda"))
    assert gpu == {"num_requests": 256, "min_input_len": 100, "max_input_len": 1024, "min_output_len": 100,
                   "max_output_len": 1024, "hf_batch_size": 64}


def test_bench_profile_runs_end_to_end_on_cpu(tmp_path):
    """`minillm bench profile` as the CLI calls it: both overlap settings, a JSON with every run."""
    from minillm.bench import profile

    res = profile.run(TINY, batch_sizes="1,2", steps=2, prompt_len=9, device="cpu", progress=False,
                      json_path=tmp_path / "p.json", block_size=4, num_gpu_blocks=64)
    assert [(r["batch_size"], r["async_scheduling"]) for r in res["runs"]] == [(1, True), (2, True), (1, False), (2, False)]
    assert {r["context_len"] for r in res["runs"]} == {9 + 3 + 2}  # prompt + warm-up + measured steps
    assert (tmp_path / "p.json").exists()


def test_profile_decode_step_on_cpu():
    from minillm.bench.serving_setup import NoTextTokenizer
    from minillm.loader import load_model

    model, _, _ = load_model(TINY, load_format="dummy")
    engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(block_size=4, num_gpu_blocks=64), progress=False)
    prof = serving.profile_decode_step(engine, 3, steps=4, warmup=1, prompt_len=5)
    assert prof["batch_size"] == 3 and prof["gpu_kernel_ms"] is None and prof["gap_ms"] is None
    for key in ("wall_ms", "schedule_ms", "prepare_ms", "launch_ms", "sample_ms", "other_ms"):
        assert prof[key] >= 0, key
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 63  # left idle
    with pytest.raises(ValueError, match="exceeds the engine's max_num_seqs"):
        serving.profile_decode_step(engine, 1000)


def test_profile_decode_step_measures_the_whole_batch_when_prefill_takes_many_steps():
    """8 prompts of 16 tokens at 16 tokens a step take 8 steps to prefill: the first requests decode
    meanwhile and must not finish before the measured passes end (they did, with room for the passes
    alone: the measured steps then ran a shrinking batch)."""
    from minillm.bench.serving_setup import NoTextTokenizer
    from minillm.loader import load_model

    model, _, _ = load_model(TINY, load_format="dummy")
    config = EngineConfig(block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16, max_num_seqs=8)
    engine = LLMEngine(model, NoTextTokenizer(), [], config, progress=False)
    prof = serving.profile_decode_step(engine, 8, steps=2, warmup=1, prompt_len=16)
    assert prof["batch_size"] == 8 and prof["wall_ms"] > 0
    assert not engine.has_unfinished_requests()


def test_profile_decode_step_steps_as_generate_does_unless_streaming():
    """By default the profile takes step() as LLM.generate and the engine core do (finished requests
    only); streaming=True takes it as a streaming caller (every request's output each step)."""
    from minillm.bench.serving_setup import NoTextTokenizer
    from minillm.loader import load_model

    model, _, _ = load_model(TINY, load_format="dummy")
    engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(block_size=4, num_gpu_blocks=64), progress=False)
    seen, step = [], engine.step

    def recording_step(unfinished_outputs=True):
        seen.append(unfinished_outputs)
        return step(unfinished_outputs=unfinished_outputs)

    engine.step = recording_step
    prof = serving.profile_decode_step(engine, 2, steps=2, warmup=1, prompt_len=3)
    assert prof["streaming"] is False and seen and not any(seen[:-1])  # the abort's drain may stream
    seen.clear()
    assert serving.profile_decode_step(engine, 2, steps=2, warmup=1, prompt_len=3, streaming=True)["streaming"]
    assert True in seen
    with pytest.raises(TypeError, match="streaming must be a bool"):
        serving.profile_decode_step(engine, 2, streaming="yes")


@pytest.mark.parametrize("mla", [False, True])
def test_decode_floor_reads_top_k_of_the_routed_experts(seed, mla):
    """A batch-1 step of a mixture of experts reads top_k of E routed experts per MoE layer; the
    shared experts, the router and the dense layers in full (the floor counted every expert before)."""
    import random

    from test_models_moe import random_moe_model

    from minillm.bench.serving_setup import load_models

    _model, config = random_moe_model(random.Random(seed), mla=mla)
    models = load_models(config, torch.device("cpu"), torch.float32)
    E, k, H, Im = config.moe.num_experts, config.moe.num_experts_per_tok, config.hidden_size, \
        config.moe.moe_intermediate_size
    moe_layers = config.num_layers - len(config.moe.dense_layers)
    everything = sum(p.numel() for p in models.model.parameters()) * 4  # fp32, tied or not as built
    if not config.tie_word_embeddings:
        everything -= (config.vocab_size - 1) * H * 4  # one row of the input embedding
    skipped = moe_layers * (E - k) * (2 * Im * H + H * Im) * 4  # w13 [2I, H] and w2 [H, I] of each unused expert
    assert models.weight_bytes() == everything - skipped
