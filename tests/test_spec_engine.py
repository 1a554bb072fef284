"""Chapter 09's engine oracle: speculative decoding changes how many tokens a step emits, never which.

With every proposer (n-gram lookup, layer skip, a separate draft model), greedy requests through the
speculating engine get exactly the tokens chapter 03's one-request path gives them: batched, with a
tiny KV pool forcing preemption (recompute and swap), prefix caching, chunked prefill, n > 1 and aborts
mid-flight. A draft model equal to the target accepts every draft, which drives long accepted runs
through the rollback: EOS, stop tokens, stop strings and max_tokens inside a run, blocks crossed by
drafts, blocks given back. Seeded sampling gives the same tokens alone and batched.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_engine import alone, blocks_for, pad_steps_eagerly, random_requests
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.generation import generate_sequences
from minillm.spec_decode import SpeculativeConfig
from minillm.spec_decode.eagle import EagleModel
from minillm.spec_decode.medusa import MedusaHeads


def spec_config(method: str, rng: random.Random, target, k: int | None = None) -> dict:
    k = k or rng.choice([1, 2, 4])
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": rng.choice([1, 2]),
                "prompt_lookup_max": 3}
    if method == "layer_skip":
        return {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": k}
    if method == "self":  # the target drafts for itself: every draft is accepted
        return {"model": target, "num_speculative_tokens": k}
    if method in ("medusa", "eagle"):  # tiny random heads / layer (test_spec_learned.py)
        return {"method": method, "model": random_drafter(method, target, rng, k), "num_speculative_tokens": k}
    draft, _ = random_model(rng)  # another random shape, the same vocabulary
    return {"model": draft, "num_speculative_tokens": k}


def random_drafter(method: str, model, rng: random.Random, k: int):
    """Medusa heads (k or more, one or two blocks, shared or own LM heads) or an EAGLE layer, random."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    c = model.config
    if method == "medusa":
        drafter = MedusaHeads(c.hidden_size, c.vocab_size, k + rng.randrange(0, 2), rng.choice([1, 2]),
                              own_lm_head=rng.random() < 0.5)
    else:
        drafter = EagleModel(model)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3, generator=gen)
    return drafter



def assert_matches_alone(got: dict, expected: list, aborted: set, ec) -> None:
    """Each request's engine tokens equal its lone run's; an aborted one's are a prefix of them."""
    for i, want in enumerate(expected):
        rid = f"r{i}"
        if rid in aborted:
            for g, w in zip(got.get(rid, []), want):
                assert g == w[: len(g)], (rid, g, w)
            continue
        assert got[rid] == want, f"{rid}: engine {got[rid]} vs alone {want} ({ec})"


def check_blocks(engine: LLMEngine) -> None:
    """Between steps: no sequence holds blocks past its tokens, and only accepted tokens' full blocks
    are named in the prefix cache."""
    bm = engine.block_manager
    pc = bm.prefix_cache
    for seq in engine.scheduler.running:
        table = bm.block_tables[seq.seq_id]
        assert len(table) <= bm.blocks_needed(seq.num_tokens), (seq.seq_id, len(table), seq.num_tokens)
        assert not seq.spec_token_ids
        if pc is not None:
            assert not any(b in pc for b in table[seq.num_computed_tokens // bm.block_size :])


def drain(engine: LLMEngine, abort: set[str] = frozenset(), at_step: int = 3) -> dict:
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = [c.token_ids for c in out.outputs]
        check_blocks(engine)
        steps += 1
        if steps == at_step and abort:
            engine.abort_request(sorted(abort))
    bm = engine.block_manager
    assert not bm.block_tables and not bm.cpu_tables and sum(bm.ref_counts) == 0  # everything given back
    return got


def repetitive_requests(rng, vocab, count):
    """Greedy requests whose prompts repeat a phrase (something for the n-gram lookup to find)."""
    out = []
    for prompt, params in random_requests(rng, vocab, count):
        if rng.random() < 0.5:
            prompt = (prompt[-6:] or [1]) * 3
        out.append((prompt, dataclasses.replace(params, temperature=0.0, seed=None, top_p=1.0)))
    return out


@pytest.mark.parametrize("method, case", [("ngram", 0), ("ngram", 1), ("layer_skip", 1), ("draft", 0), ("self", 1)])
def test_speculating_engine_matches_plain_greedy(seed, tok, method, case):
    rng = random.Random(seed * 100 + case + 17 * len(method))
    model, config = random_model(rng)
    requests = repetitive_requests(rng, config.vocab_size, rng.randrange(4, 9))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    block_size = rng.choice([1, 2, 4])
    ec = EngineConfig(block_size=block_size, num_gpu_blocks=blocks_for(requests, block_size) + 6 + rng.randrange(0, 6),
                      num_cpu_blocks=64, preemption_mode=["recompute", "swap"][case],
                      enable_prefix_caching=[None, "hash", "radix"][rng.randrange(3)],
                      max_num_batched_tokens=rng.randrange(8, 40), max_num_seqs=rng.randrange(3, 9),
                      speculative_config=spec_config(method, rng, model))
    engine = LLMEngine(model, tok, [], ec)
    aborted = {f"r{i}" for i in range(len(requests)) if rng.random() < 0.15}
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, priority=rng.choice([0, 0, 1]))
    got = drain(engine, aborted)
    assert_matches_alone(got, expected, aborted, ec)
    spec = engine.engine_stats.spec
    assert spec.num_draft_tokens > 0 or method == "ngram"
    if method == "self":
        assert spec.num_accepted_tokens == spec.num_draft_tokens > 0  # the target agrees with itself


def test_preemption_under_pressure_with_drafts(seed, tok):
    """Long requests, a pool that holds about one: sequences with drafts are preempted and resume."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    greedy = SamplingParams(max_tokens=28, temperature=0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(10)] for _ in range(4)]
    want = [alone(model, tok, p, greedy) for p in prompts]
    for mode, spec in (("recompute", {"model": model}), ("swap", {"method": "layer_skip", "num_draft_layers": 1})):
        engine = LLMEngine(model, tok, [], EngineConfig(
            block_size=4, num_gpu_blocks=13, num_cpu_blocks=40, preemption_mode=mode, max_num_batched_tokens=64,
            speculative_config=spec | {"num_speculative_tokens": 3},
            kv_eviction="none"))  # a window's eviction (chapter 15) would relieve the pressure
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
        got = drain(engine)
        assert [got[str(i)] for i in range(4)] == want
        assert engine.stats["num_preemptions"] > 0, mode
        assert engine.stats["spec_num_accepted_tokens"] > 0


def greedy_run(model, tok, prompt, n=24):
    *_, seqs = generate_sequences(model, tok, prompt, SamplingParams(max_tokens=n, temperature=0), [])
    return seqs[0]


@pytest.mark.parametrize("stop", ["eos", "stop_token", "stop_string", "max_tokens"])
def test_a_stop_inside_an_accepted_run(seed, tok, stop):
    """A draft = target accepts k tokens a step; the stop lands in the middle of a run and the tokens
    after it are dropped, exactly as plain decoding stops there."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    for _ in range(50):  # a prompt whose greedy output has a token first seen at index 3 or later
        prompt = [rng.randrange(config.vocab_size) for _ in range(7)]
        plain = greedy_run(model, tok, prompt)
        ids = plain.output_ids
        # the output token that ends the request (0-based): its first occurrence, so that drafting steps
        # run before it (a token also seen at 0 would end the request at its prefill, before any draft)
        at = next((i for i in range(3, len(ids)) if ids[i] not in ids[:i]), None)
        if at is not None:
            break
    else:
        raise AssertionError("no prompt of 50 gave an output with a new token after index 3")
    eos, params = [], SamplingParams(max_tokens=24, temperature=0)
    if stop == "eos":
        eos = [plain.output_ids[at]]
    elif stop == "stop_token":
        params.stop_token_ids = [plain.output_ids[at]]
    elif stop == "stop_string":  # three characters of the plain text: the output ends before their first match
        if len(plain.text) < 12:
            pytest.skip(f"the plain output decodes to only {len(plain.text)} characters")
        params.stop = [plain.text[8:11]]
    else:
        params.max_tokens = at + 1
    want = alone(model, tok, prompt, params, eos)[0]
    engine = LLMEngine(model, tok, eos, EngineConfig(block_size=2, num_gpu_blocks=64,
                                                     speculative_config={"model": model, "num_speculative_tokens": 4}))
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    got = drain(engine)
    assert got["r"][0] == want and len(want) <= (at + 1 if stop != "stop_string" else 23), (got, want)
    assert engine.engine_stats.spec.num_accepted_tokens > 0


def test_drafts_switch_off_for_a_large_batch_and_requests_that_need_plain_steps(seed, tok):
    """disable_by_batch_size: no drafts while more sequences run; penalties and logprobs: never any
    (their distribution depends on the tokens just accepted). The tokens stay those of plain decoding."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(6)] for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0)
    want = [alone(model, tok, p, params)[0] for p in prompts]
    engine = LLMEngine(model, tok, [], EngineConfig(num_gpu_blocks=64, speculative_config={
        "model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 2}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    got = drain(engine)
    assert [got[str(i)][0] for i in range(3)] == want
    assert engine.engine_stats.spec.num_drafts == 0  # three running: more than 2
    special = [SamplingParams(max_tokens=8, temperature=0, logprobs=2),
               SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3),
               SamplingParams(max_tokens=8, temperature=0, min_tokens=8)]
    for i, sp in enumerate(special):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompts[0]}, sp)
    got = drain(engine)
    assert [got[f"s{i}"][0] for i in range(3)] == [alone(model, tok, prompts[0], sp)[0] for sp in special]
    assert engine.engine_stats.spec.num_drafts == 0


def test_back_off_pauses_a_sequence_whose_drafts_fail(seed, tok):
    """min_acceptance_rate: zero-acceptance verifies pause drafting 8, 16, 32, ... 128 output tokens; a probe
    that is accepted ends the back-off. Through the engine: fewer drafts, the same tokens as plain decoding."""
    from types import SimpleNamespace

    from minillm.engine.spec_decode_steps import SpecDecodeSteps
    from minillm.sequence import Sequence

    host = SimpleNamespace(spec_config=SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0.3}))
    seq = Sequence(0, [1, 2, 3], SamplingParams(), 0, None, [], 10**6)
    SpecDecodeSteps._back_off(host, seq, 4, 0)  # 1.0 -> 0.5: still drafting
    assert seq.spec_resume_at == 0
    pauses = []
    for _ in range(6):
        SpecDecodeSteps._back_off(host, seq, 4, 0)
        pauses.append(seq.spec_resume_at - len(seq.output_ids))
        seq.output_ids += [5] * pauses[-1]  # the pause passes
    assert pauses == [8, 16, 32, 64, 128, 128]
    SpecDecodeSteps._back_off(host, seq, 4, 3)  # a good probe: drafting goes on, the next pause starts at 8
    assert seq.spec_pause == 0 and seq.spec_resume_at <= len(seq.output_ids)

    rng = random.Random(seed)
    model, config = random_model(rng)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(4)] * 4 for _ in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = {tuple(p): alone(model, tok, p, params)[0] for p in prompts}

    def wrong(seqs, num_spec, block_tables):  # drafts the target always rejects at their first token
        nxt = [want[tuple(s.prompt_ids)][len(s.output_ids)] for s in seqs]
        return [[(t + 1) % config.vocab_size] * k for t, k in zip(nxt, num_spec)], None

    def run(rate):
        engine = LLMEngine(model, tok, [], EngineConfig(num_gpu_blocks=128, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": rate}))
        engine.proposer.propose = wrong
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        got = drain(engine)
        return [got[str(i)][0] for i in range(len(prompts))], engine.engine_stats.spec

    always, eager = run(None)
    backed_off, calm = run(0.5)
    assert always == backed_off == list(want.values())
    assert eager.num_accepted_tokens == calm.num_accepted_tokens == 0
    # without the back-off a sequence drafts at nearly every one of its 40 tokens; with it, after its first
    # two verifies (rate 1 -> 0.5 -> 0.25) it pauses 8, then 16, then 32 tokens: about 4 verifies each
    assert eager.num_drafts >= 30 * len(prompts) and 0 < calm.num_drafts <= 5 * len(prompts), \
        (calm.num_drafts, eager.num_drafts)


# EAGLE fails this on most seeds (4 of 6 tried, also on its own branch before any merge): a seeded request's
# tokens then depend on what it is batched with. An open defect of issue 46, recorded, not hidden: the case
# still runs and reports XFAIL or XPASS; greedy EAGLE = plain decoding holds (test_spec_learned.py).
EAGLE_SEEDED = pytest.param("eagle", marks=pytest.mark.xfail(
    reason="issue 46: EAGLE's seeded sampling differs alone vs batched on most seeds (open defect)", strict=False))


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft", "medusa", EAGLE_SEEDED])
def test_seeded_sampling_with_drafts_is_the_same_alone_and_batched(seed, tok, method):
    rng = random.Random(seed + 3)
    model, config = random_model(rng)
    spec = spec_config(method, rng, model, k=3)  # Medusa needs heads for every draft
    requests = [((p[-5:] or [1]) * 3, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=rng.randrange(1000),
                                                     n=rng.choice([1, 2])))
                for p, _ in random_requests(rng, config.vocab_size, 5)]

    def run(reqs):
        engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=128, speculative_config=spec))
        for i, (p, sp) in reqs:
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        return drain(engine), engine.engine_stats.spec

    batched, stats = run(list(enumerate(requests)))
    for i, r in enumerate(requests):
        assert run([(i, r)])[0][f"r{i}"] == batched[f"r{i}"]
    assert stats.num_draft_tokens > 0 or method == "ngram"


def test_request_outputs_and_stats_carry_the_acceptance(seed, tok):
    rng = random.Random(seed)
    model, _ = random_model(rng)
    engine = LLMEngine(model, tok, [], EngineConfig(num_gpu_blocks=64, speculative_config={
        "method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2}))
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=10, temperature=0))
    last = None
    while engine.has_unfinished_requests():
        last = engine.step()[-1:] or last
    spec = last[0].spec
    stats = engine.stats
    assert spec.num_draft_tokens == stats["spec_num_draft_tokens"] > 0
    assert stats["spec_mean_acceptance_length"] == 1 + spec.num_accepted_tokens / spec.num_drafts
    assert len(stats["spec_acceptance_per_position"]) == 2
    assert spec.num_accepted_tokens + spec.num_drafts <= 10  # every verify emits accepted + 1 tokens


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive int"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "must be <= 32"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "hydra", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' needs a 'model'"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "x", "num_draft_layers": 1}, "belongs to method"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "x", "adaptive": 1}, "adaptive must be"),
    ({"method": "medusa", "num_speculative_tokens": 2, "model": "x", "draft_cost": -1}, "draft_cost"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 1}, "belongs to method 'layer_skip'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs num_draft_layers"),
    ("ngram", "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": "0.3"}, "min_acceptance_rate"),
])
def test_bad_speculative_configs_are_refused(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(speculative_config=spec)


def test_bad_speculative_configs_for_the_model_are_refused(seed, tok):
    rng = random.Random(seed)
    model, config = random_model(rng)
    other_vocab, _ = random_model(rng, vocab_size=config.vocab_size + 1)
    cases = [({"method": "layer_skip", "num_draft_layers": 2, "num_speculative_tokens": 2}, "in \\[1, 1\\]"),
             ({"model": other_vocab, "num_speculative_tokens": 2}, "vocabulary"),
             ({"method": "ngram", "num_speculative_tokens": 20}, "max_model_len=16")]
    for spec, match in cases:
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, tok, [], EngineConfig(num_gpu_blocks=16, max_model_len=16, speculative_config=spec))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert SpeculativeConfig.from_dict({"model": model, "num_speculative_tokens": 1}).method == "draft_model"


@pytest.mark.parametrize("method", ["self", "layer_skip"])
def test_verify_steps_replay_the_padded_graph_steps(seed, tok, method):
    """A step with drafts fits a token bucket's graph (1 + k logits rows a sequence), the draft's passes
    its own decode and bucket graphs: on a CPU the padded static buffers run eagerly, held to the same
    oracle."""
    rng = random.Random(seed)
    model, config = random_model(rng)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4,
                                                    speculative_config=spec_config(method, rng, model)
                                                    | {"num_speculative_tokens": 3}))
    pad_steps_eagerly(engine)
    engine.proposer.graphs = draft_graphs = engine.runner.make_graphs(capture=False, model=engine.proposer.model)
    graphs, verified = engine.runner.graphs, []
    run = graphs.run

    def spy(shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices, *patch):
        verified.append(len(logits_indices) > len(seq_lens))
        return run(shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices, *patch)

    graphs.run = spy
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
    got = drain(engine)
    assert [got[str(i)] for i in range(3)] == [alone(model, tok, p, greedy) for p in prompts]
    assert any(verified) and engine.engine_stats.spec.num_draft_tokens > 0
    assert any(shape.max_seqlen == 1 for shape in draft_graphs.replays)  # one-token draft passes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the embedded model, CUDA graphs)")
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "layer_skip", "num_draft_layers": 8, "num_speculative_tokens": 3}])
def test_embedded_model_on_gpu_speculates_to_the_plain_tokens(spec):
    """fp32 on the GPU with CUDA graphs: input-grounded prompts give the same tokens with and without drafts."""
    from minillm import LLM

    llm = LLM(dtype="float32", device="cuda", max_num_seqs=8)
    text = "The lighthouse was first lit in 1791. Its keeper climbed one hundred and twelve steps every evening."
    prompts = [f"Repeat this sentence twice: {text}", f"Summarize: {text}", "Count from one to twenty in words."]
    greedy = SamplingParams(max_tokens=48, temperature=0)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    llm.engine.shutdown()
    spec_llm = LLM(dtype="float32", device="cuda", max_num_seqs=8, speculative_config=spec)
    outs = spec_llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert spec_llm.engine.engine_stats.spec.num_draft_tokens > 0


def test_a_failing_proposer_ends_only_the_requests_it_drafted_for(seed, tok, monkeypatch):
    rng = random.Random(seed)
    model, _ = random_model(rng)
    engine = LLMEngine(model, tok, [], EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=16, speculative_config={
        "method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2}))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, greedy)
    engine.step()  # a's prompt: it decodes from now on
    engine.add_request("b", {"prompt_token_ids": list(range(5, 25))}, greedy)  # prefilling beside a's drafts

    def broken(*args):
        raise RuntimeError("draft kernel exploded")

    monkeypatch.setattr(engine.proposer, "propose", broken)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].outputs[0].finish_reason == "error" and "exploded" in outs["a"].error
    monkeypatch.undo()
    got = drain(engine)
    assert got["b"] == alone(model, tok, list(range(5, 25)), greedy)


def test_cli_flags_make_the_speculative_config():
    from minillm.cli import build_parser
    from minillm.spec_decode.config import from_cli_args

    parse = build_parser().parse_args
    args = parse(["generate", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                  "--prompt-lookup-max", "4"])
    assert from_cli_args(args) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = parse(["chat", "--speculative-model", "draft.gguf", "--num-speculative-tokens", "2"])
    assert SpeculativeConfig.from_dict(from_cli_args(args)).method == "draft_model"
    assert from_cli_args(parse(["generate", "hi"])) is None
    args = parse(["generate", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                  "--speculative-min-acceptance-rate", "0.25"])
    assert SpeculativeConfig.from_dict(from_cli_args(args)).min_acceptance_rate == 0.25
    with pytest.raises(ValueError, match="need --speculative-method"):
        from_cli_args(parse(["generate", "hi", "--num-speculative-tokens", "2"]))
