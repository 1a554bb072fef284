"""What a hostile-but-realistic user does to the engine: requests that pass a first look and fail in a
step, lists that are refused half-way, params edited behind the engine's back, ids of the wrong type.
The engine refuses what it can before queueing, fails only the requests a failing step concerns, and
serves everyone else with the tokens they get alone."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import alone
from tiny_models import make_tiny, random_model

from minillm import LLM, SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.step_input import prepare_model_input


def _engine(seed, tok, **cfg):
    rng = random.Random(seed)
    model, _config = random_model(rng)
    return LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, **cfg)), model, rng


def _drain(engine) -> dict:
    outs = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return outs
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    raise AssertionError("the engine never finished its requests")


def _idle_and_empty(engine) -> bool:
    bm = engine.block_manager
    return (not engine.has_unfinished_requests() and not engine.groups and not bm.block_tables
            and bm.num_free_blocks == bm.num_blocks - 1)


def test_token_ids_outside_the_vocabulary_are_refused_up_front(seed, tok):
    engine, model, _ = _engine(seed, tok)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):  # used to pass, then fail every step after
        engine.add_request("bad", {"prompt_token_ids": [1, 2]}, SamplingParams(min_tokens=2, stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match=r"eos_token_ids \[97\] are not token ids of this model"):
        LLMEngine(model, tok, [vocab], EngineConfig(num_gpu_blocks=8))
    assert not engine.has_unfinished_requests()


def test_a_failing_sample_ends_only_its_own_request(seed, tok, monkeypatch):
    engine, model, rng = _engine(seed, tok)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(4)]
    poison = SamplingParams(max_tokens=6, temperature=0.8, seed=666, logprobs=1)
    worker_sampler = engine.executor.worker.sampler
    real = worker_sampler.sample_rows

    def sample(raw, masked, s, seqs):  # one request's sampling breaks, as a bug or a bad value would
        if any(s.params[i].seed == 666 for i in seqs):
            raise FloatingPointError("poisoned row")
        return real(raw, masked, s, seqs)

    monkeypatch.setattr(worker_sampler, "sample_rows", sample)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        if i == 1:
            engine.add_request("poison", {"prompt_token_ids": p}, poison)
    outs = _drain(engine)
    bad = outs["poison"]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and "poisoned row" in bad.error
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert outs[f"r{i}"].error is None and [c.token_ids for c in outs[f"r{i}"].outputs] == alone(model, tok, p, sp)
    assert _idle_and_empty(engine) and engine.engine_stats.num_failed_requests == 1


def test_a_failing_forward_ends_its_step_and_the_engine_goes_on(seed, tok, monkeypatch):
    engine, model, rng = _engine(seed, tok, max_num_batched_tokens=8)
    real, calls = engine.executor.execute_model, []

    def execute(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(*args)

    monkeypatch.setattr(engine.executor, "execute_model", execute)
    prompts = [[rng.randrange(97) for _ in range(6)] for _ in range(3)]
    sp = SamplingParams(max_tokens=4, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    outs = _drain(engine)
    failed = {r for r, o in outs.items() if o.error}
    assert failed and all("illegal memory access" in outs[r].error for r in failed)
    for r in set(outs) - failed:
        assert [c.token_ids for c in outs[r].outputs] == alone(model, tok, prompts[int(r[1])], sp)
    assert _idle_and_empty(engine)
    engine.add_request("after", {"prompt_token_ids": prompts[0]}, sp)  # the engine still serves
    assert [c.token_ids for c in _drain(engine)["after"].outputs] == alone(model, tok, prompts[0], sp)


def test_params_are_checked_when_added_and_copied(seed, tok):
    engine, _model, _ = _engine(seed, tok)
    sp = SamplingParams(max_tokens=3, temperature=0)
    sp.n = 0  # edited after construction: used to leave a request with no sequence, forever unfinished
    with pytest.raises(ValueError, match="n must be"):
        engine.add_request("zero", {"prompt_token_ids": [1, 2]}, sp)
    sp.n = 1
    engine.add_request("ok", {"prompt_token_ids": [1, 2]}, sp)
    sp.max_tokens = 50  # the engine's copy keeps what was checked
    sp.stop_token_ids.append(7)  # its lists too: a shallow copy must not share them
    sp.stop.append("x")
    params = engine.groups["ok"].params
    assert params is not sp and params.stop_token_ids == [] and params.stop == []
    out = _drain(engine)["ok"]
    assert len(out.outputs[0].token_ids) == 3 and _idle_and_empty(engine)


def test_a_checked_request_is_queued_as_checked(seed, tok, monkeypatch):
    """The engine core's intake (add_checked): what check_request returned is queued as it is, its params
    neither copied nor verified again; the cheap guards that protect a batch stay."""
    engine, _model, _ = _engine(seed, tok)
    text, ids, params = engine.check_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, temperature=0))
    verified = []
    monkeypatch.setattr(SamplingParams, "verify", lambda self, vocab_size=None: verified.append(self))
    engine.add_checked("a", text, ids, params)
    assert engine.groups["a"].params is params and verified == []
    with pytest.raises(ValueError, match="already in use"):
        engine.add_checked("a", text, ids, params)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # skipped the check: refused, not run
        engine.add_checked("b", None, [10**6], params)
    with pytest.raises(ValueError, match="context"):
        engine.add_checked("c", None, [1] * engine.max_model_len, params)
    assert list(engine.groups) == ["a"]
    assert len(_drain(engine)["a"].outputs[0].token_ids) == 3 and _idle_and_empty(engine)


def test_request_ids_must_be_strings(seed, tok):
    engine, _, _ = _engine(seed, tok)
    with pytest.raises(TypeError, match="request_id must be a str"):
        engine.add_request(5, {"prompt_token_ids": [1]}, SamplingParams())
    with pytest.raises(TypeError, match="request_id must be a str or a list of str"):
        engine.abort_request(5)
    with pytest.raises(TypeError, match="request ids are str"):
        engine.abort_request(["a", 5])


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, True])
def test_swap_space_must_be_a_finite_size(value):
    with pytest.raises(ValueError, match="swap_space must be a number of GiB"):
        EngineConfig(swap_space=value)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    return LLM(make_tiny("llama2-tied", tmp_path_factory.mktemp("tiny")), device="cpu", max_num_seqs=4,
               num_gpu_blocks=64)


def test_generate_checks_every_request_before_queueing_any(tiny_llm):
    ok = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match=r"prompts\[2\].*max_num_seqs"):
        tiny_llm.generate(["a", "b", "c"], [ok, ok, SamplingParams(n=5)])
    assert not tiny_llm.engine.groups and not tiny_llm.engine.has_unfinished_requests()
    again = tiny_llm.generate(["a", "b"], ok)  # used to raise KeyError on the leftovers
    assert [len(o.outputs[0].token_ids) for o in again] == [3, 3]


def test_generate_raises_when_the_engine_fails_a_request(tiny_llm, monkeypatch):
    real = tiny_llm.engine.executor.execute_model
    monkeypatch.setattr(tiny_llm.engine.executor, "execute_model", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match=r"prompts\[0\] failed in the engine: RuntimeError: boom"):
        tiny_llm.generate(["a", "b"], SamplingParams(max_tokens=2))
    monkeypatch.setattr(tiny_llm.engine.executor, "execute_model", real)
    assert not tiny_llm.engine.groups and not tiny_llm.engine.has_unfinished_requests()
    assert len(tiny_llm.generate("a", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids) == 2


@torch.inference_mode()
def test_runner_gives_logits_at_any_rows(seed, tok):
    """logits_indices may name several rows of one sequence (chapter 09 verifies draft tokens so): each
    row's logits are the full forward pass's at that position."""
    from minillm.layers import AttentionMetadata

    engine, model, rng = _engine(seed, tok)
    prompt = [rng.randrange(97) for _ in range(9)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    rows = sorted(rng.sample(range(9), 4))
    step = prepare_model_input(sched.scheduled, engine.block_manager.block_tables, engine.config.block_size, rows)
    got = engine.executor.execute_model(step).logits  # [4, vocab]: the step asked for no sampling
    engine.abort_request("r")
    hidden = model(torch.tensor(prompt), torch.arange(9), AttentionMetadata.from_seq_lens([9]))
    torch.testing.assert_close(got, model.compute_logits(hidden)[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_min": 1}])
def test_nan_logits_never_become_a_token_on_the_greedy_fast_paths(seed, tok, monkeypatch, speculative_config):
    """A NaN in a row of logits (a broken model, an fp16 overflow): torch's argmax picks the NaN's position.
    The engine's greedy shortcuts (one argmax for the batch, the host-side greedy verify) must give what the
    Sampler's guard gives, never that token; with drafts the same tokens as without."""
    rng = random.Random(seed)
    model, _ = random_model(rng)
    nan_col = rng.randrange(model.config.vocab_size)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(2, 10))] for _ in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(spec, poison: bool):
        engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, speculative_config=spec))
        runner = engine.executor.worker.runner
        real = runner.execute

        def execute(*args):  # the forward pass's logits, before the worker samples them
            logits = real(*args)  # [rows, vocab]
            return logits.index_fill(1, torch.tensor([nan_col]), float("nan")) if poison else logits

        monkeypatch.setattr(runner, "execute", execute)
        if spec:  # drafts every step, and the NaN's own token at that: a verify must never accept it
            monkeypatch.setattr(engine.executor, "propose", lambda seqs, ks, tables: ([[nan_col] * k for k in ks], None))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        outs = _drain(engine)
        assert all(o.error is None for o in outs.values()), [o.error for o in outs.values()]
        return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], engine

    got, engine = run(speculative_config, poison=True)
    assert all(nan_col not in tokens for tokens in got)
    if speculative_config:
        assert engine.engine_stats.spec.num_draft_tokens > 0  # the verify path did run
        assert got == run(None, poison=True)[0]


def test_greedy_tokens_flags_broken_rows():
    from minillm.worker.sample_step import greedy_tokens

    nan, inf = float("nan"), float("inf")
    assert greedy_tokens(torch.tensor([[0.0, 3.0, 1.0], [inf, 0.0, 1.0]])) == [1, 0]
    assert greedy_tokens(torch.tensor([[0.0, nan, 1.0], [0.0, 2.0, 1.0]])) is None
    assert greedy_tokens(torch.tensor([[-inf, -inf, -inf], [0.0, 2.0, 1.0]])) is None


def test_a_failed_request_is_logged_in_one_line(seed, tok, monkeypatch, caplog):
    """Issue 30: a request whose step fails is logged as one line naming it and the error; the traceback
    only at debug level (a server with many broken requests must not flood its log)."""
    engine, _, rng = _engine(seed, tok)
    monkeypatch.setattr(engine.executor, "execute_model", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request("r", {"prompt_token_ids": [rng.randrange(97) for _ in range(5)]}, SamplingParams(max_tokens=2))
    with caplog.at_level("ERROR", logger="minillm.engine.llm_engine"):
        outs = _drain(engine)
    assert outs["r"].error == "RuntimeError: boom"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "'r' failed in its step: RuntimeError: boom" in errors[0].getMessage()
