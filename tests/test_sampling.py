"""Chapter 02's sampler: the filters equal HF's logits processors row by row, sampled frequencies
match the exact filtered distribution, a seed's tokens do not depend on the batch, and stop rules
(strings that straddle tokens included) end a completion at the right character."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minillm.sampling import Sampler, SamplingMetadata, SamplingParams, filtered_probs, uniforms
from minillm.sequence import Sequence

V = 64


def _meta(params, seeds=None, steps=None, prompts=None, outputs=None, banned=None, vocab=V):
    B = len(params)
    outputs = outputs or [[] for _ in range(B)]
    m = SamplingMetadata.build(params, prompts or [[] for _ in range(B)], outputs, seeds or list(range(B)),
                               banned or [[] for _ in range(B)], vocab, "cpu")
    if steps is not None:
        m.steps = torch.tensor(steps)
    return m


def _hf_filtered(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The oracle: HF's own warpers, in generate's order, for one row."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = row[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if p.temperature not in (0, 1):
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.softmax(scores, -1)[0]


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 1, 5, 20, V]),
                          top_p=rng.choice([1.0, 0.9, 0.5, 0.1]), min_p=rng.choice([0.0, 0.05, 0.2]))


def test_filters_equal_hf_warpers_per_row(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [_random_params(rng) for _ in range(32)]
    logits = torch.randn(32, V) * 3
    probs = filtered_probs(logits, _meta(params))
    for i, p in enumerate(params):
        assert torch.allclose(probs[i], _hf_filtered(logits[i], p), atol=1e-6), p


def test_penalties_equal_hf_and_openai(seed):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from minillm.sampling import apply_penalties

    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompt = [rng.randrange(V) for _ in range(10)]
    output = [rng.randrange(V) for _ in range(15)]
    logits = torch.randn(1, V) * 3
    p = SamplingParams(repetition_penalty=1.3)
    ours = apply_penalties(logits, _meta([p], prompts=[prompt], outputs=[output]))
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, theirs)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits, _meta([p], prompts=[prompt], outputs=[output]))
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    assert torch.allclose(ours[0], logits[0] - 0.25 * counts - 0.5 * (counts > 0).float())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
])
def test_sampled_frequencies_match_the_filtered_distribution(params):
    """N draws of one row (steps 0..N-1, a fixed seed): every token's count lies within 5 standard
    deviations of N*p (a false alarm has probability < 1e-4 over the whole test), and tokens the
    filters removed never appear."""
    torch.manual_seed(1234)
    N = 40_000
    logits = torch.randn(V) * 2
    exact = filtered_probs(logits[None], _meta([params]))[0].double()
    meta = _meta([params] * N, seeds=[777] * N, steps=list(range(N)))
    tokens = Sampler()(logits.expand(N, V).clone(), meta).token_ids
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[exact == 0].sum() == 0
    sd = (N * exact * (1 - exact)).sqrt()
    worst = ((counts - N * exact).abs() / sd.clamp_min(1e-9))[exact > 0].max().item()
    assert worst < 5, worst


def test_seeded_rows_do_not_depend_on_the_batch(seed):
    torch.manual_seed(seed)
    logits = torch.randn(5, V)
    params = [SamplingParams(temperature=1.0, top_p=0.9) for _ in range(5)]
    seeds = [11, 22, 33, 44, 55]
    together = Sampler()(logits, _meta(params, seeds=seeds, steps=[3] * 5)).token_ids
    for i in range(5):
        alone = Sampler()(logits[i:i + 1], _meta(params[i:i + 1], seeds=seeds[i:i + 1], steps=[3])).token_ids
        assert alone.item() == together[i].item()


def test_uniforms_never_reach_0_or_1():
    from minillm.sampling.rng import to_unit

    edges = to_unit(torch.tensor([0, 1, 511, 512, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.int64))
    assert (edges > 0).all() and (edges < 1).all(), edges  # -log(u) must be finite and positive


def test_uniforms_are_uniform_and_deterministic():
    u = uniforms(torch.tensor([5, 6]), torch.tensor([0, 0]), 100_000)
    assert torch.equal(u, uniforms(torch.tensor([5, 6]), torch.tensor([0, 0]), 100_000))
    assert 0 < u.min() and u.max() < 1
    for row in u:
        assert abs(row.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / 1e5)
        hist = torch.histc(row, bins=10, min=0, max=1)
        assert (hist - 1e4).abs().max() < 5 * math.sqrt(1e4 * 0.9)
    assert (u[0] - u[1]).abs().mean() > 0.3  # different seeds, unrelated numbers
    if torch.cuda.is_available():  # the same numbers on a GPU
        assert torch.equal(u, uniforms(torch.tensor([5, 6]).cuda(), torch.tensor([0, 0]).cuda(), 100_000).cpu())


def test_greedy_min_tokens_and_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    out = Sampler()(logits, _meta([SamplingParams(temperature=0, logprobs=2)], vocab=4))
    assert out.token_ids.item() == 1 and out.ranks.item() == 1
    assert math.isclose(out.logprobs.item(), torch.log_softmax(logits, -1)[0, 1].item(), rel_tol=1e-6)
    assert out.top_ids[0].tolist() == [1, 3]
    banned = Sampler()(logits, _meta([SamplingParams(temperature=0)], banned=[[1]], vocab=4))
    assert banned.token_ids.item() == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p must be in"), (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-2), "top_k must be"), (dict(min_p=2), "min_p must be"),
    (dict(n=0), "n must be"), (dict(max_tokens=0), "max_tokens must be"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(stop=[""]), r"stop\[0\]"),
    (dict(logprobs=100), "logprobs must be"), (dict(seed=-1), "seed must be"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [(dict(n=1.5), "n must be an int"), (dict(temperature="hot"), "temperature must be a number"),
                                          (dict(ignore_eos="yes"), "ignore_eos must be a bool")])
def test_wrong_types_name_the_field(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


# ---- stopping ----------------------------------------------------------------------------------


def _feed(tok, text: str, params: SamplingParams, eos=(2,)):
    seq = Sequence(0, [1], params, 0, tok, list(eos), 10_000)
    shown = ""
    for t in tok.encode(text):
        seq.append(t)
        shown += seq.stream_delta()
        if seq.finished:
            break
    return seq, shown


def test_stop_string_straddling_tokens(tok):
    text = "Hello world. The end is near."
    stop = "world. The"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # no single token holds it: it spans several
    seq, shown = _feed(tok, text, SamplingParams(stop=[stop], max_tokens=100))
    assert (seq.text, seq.finish_reason, seq.stop_reason) == ("Hello ", "stop", stop)
    assert shown == "Hello "  # the half-formed stop string was never streamed
    seq, _ = _feed(tok, text, SamplingParams(stop=[stop], include_stop_str_in_output=True, max_tokens=100))
    assert seq.text == "Hello world. The"


def test_stop_tokens_eos_and_length(tok):
    ids = tok.encode("one two three four")
    seq, _ = _feed(tok, "one two three four", SamplingParams(stop_token_ids=[ids[2]], max_tokens=100))
    assert seq.finish_reason == "stop" and seq.stop_reason == ids[2] and seq.output_ids == ids[:3]
    seq, _ = _feed(tok, "one two<|im_end|> three", SamplingParams(max_tokens=100))
    assert seq.finish_reason == "stop" and seq.text == "one two" and seq.stop_reason is None
    seq, _ = _feed(tok, "one two<|im_end|> three", SamplingParams(max_tokens=100, ignore_eos=True))
    assert seq.finish_reason is None
    seq, _ = _feed(tok, "one two three four", SamplingParams(max_tokens=2))
    assert seq.finish_reason == "length" and len(seq.output_ids) == 2


# ---- values the sampler cannot compute in float32, and the sampler's guard ---------------------


def _one_row(params, logits, banned=None, prompts=None):
    meta = _meta([params], banned=banned, prompts=prompts, vocab=logits.shape[-1])
    return Sampler()(logits[None].clone(), meta).token_ids.item()


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_p=1e-300), r"top_p must be in \(0, 1\].*0 in float32"),
    (dict(repetition_penalty=1e-45), "repetition_penalty must be > 0.*smallest normal"),
    (dict(temperature=float("inf")), "temperature must be >= 0.*finite"),
    (dict(temperature=1e39), "temperature must be >= 0.*finite in float32"),  # finite in Python, inf in float32
    (dict(repetition_penalty=float("inf")), "repetition_penalty.*finite"),
    (dict(top_p=float("nan")), "top_p"), (dict(min_p=float("inf")), "min_p"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
])
def test_values_the_sampler_cannot_compute_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_tiny_temperatures_are_greedy():
    """The rule (vLLM's): a temperature below 1e-5 samples greedily; it used to overflow logits / T to
    inf, the softmax to NaN, and the race's argmax to token 0."""
    logits = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.0, 0.0])
    for t in (1e-40, 1e-6, 5e-324):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.0 and p.greedy
        assert _one_row(p, logits) == 1
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # the boundary itself still samples


def test_the_old_token_0_cases_now_pick_a_real_token():
    """Each of these gave token 0 (a NaN row) before; each is now refused or computed."""
    logits = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.0, 0.0])
    assert _one_row(SamplingParams(temperature=1e-40), logits) == 1
    for kwargs in (dict(top_p=1e-300), dict(repetition_penalty=1e-45), dict(temperature=float("inf"), min_tokens=2)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    # the smallest allowed values still give a sensible token, never a NaN row
    assert _one_row(SamplingParams(top_p=1e-45), logits) == 1
    seen = [1, 4]  # both positive: divided by a tiny penalty they become huge (or inf), and win
    assert _one_row(SamplingParams(repetition_penalty=1.2e-38, temperature=1.0), logits, prompts=[seen]) == 1


def test_sampler_guard_nan_and_inf_rows_never_become_token_0():
    """Rows the sampler cannot turn into a distribution fall back to the argmax of their finite scores
    (NaN ignored, +inf the largest), greedy and sampled rows alike."""
    nan, inf = float("nan"), float("inf")
    V6 = 6
    rows = torch.tensor([
        [nan, 1.0, 5.0, nan, 2.0, 0.0],  # the model emitted NaNs: token 2, never a NaN's position
        [nan, 1.0, 5.0, nan, 2.0, 0.0],  # the same, sampled
        [0.0, 1.0, 2.0, inf, 2.0, 0.0],  # +inf: softmax -> NaN; the +inf token is the limit
        [-inf, -inf, -inf, -inf, 7.0, -inf],  # 4 is banned below: nothing allowed is finite after the ban
        [1.0, 3.0, -2.0, 0.5, 2.0, 0.0],  # overflowing temperature (set past the params' checks)
        [1.0, 3.0, -2.0, 0.5, 2.0, 0.0],  # top_p of 0 in float32 (set past the params' checks)
    ])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    meta = _meta(params, banned=[[], [], [], [], [], []], vocab=V6)
    meta.temperature[4] = 1e-40  # logits / T overflows to inf
    meta.top_p[5] = 0.0  # every token filtered out
    tokens = Sampler()(rows[:3].clone(), _sub(meta, slice(0, 3))).token_ids.tolist()
    assert tokens == [2, 2, 3]
    assert Sampler()(rows[4:].clone(), _sub(meta, slice(4, 6))).token_ids.tolist() == [1, 1]
    # a row with no allowed finite score: the raw argmax among allowed tokens, else a clear error
    ban = _meta([params[3]], banned=[[4]], vocab=V6)
    with pytest.raises(ValueError, match=r"row\(s\) \[0\].*no finite value"):
        Sampler()(rows[3:4].clone(), ban)
    all_nan = torch.full((1, V6), nan)
    with pytest.raises(ValueError, match="no finite value"):
        Sampler()(all_nan, _meta([SamplingParams(temperature=0)], vocab=V6))


def _sub(meta, rows):
    """The metadata of a slice of the batch's rows."""
    import dataclasses

    def cut(v):
        return v[rows] if isinstance(v, torch.Tensor) else v
    return dataclasses.replace(meta, **{f.name: cut(getattr(meta, f.name)) for f in dataclasses.fields(meta)})


def test_sampler_guard_overflowing_penalty_falls_back_to_the_limit():
    """A repetition penalty that overflows a seen logit to +inf: the row's distribution is NaN; the
    fallback is the token the overflow stood for (the seen token with the largest positive logit)."""
    logits = torch.tensor([1.0, 3.0e30, -2.0, 0.5, 2.0, 0.0])
    assert _one_row(SamplingParams(repetition_penalty=1e-9, temperature=0.7), logits, prompts=[[1, 4]]) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(stop=5), "stop must be a string or a list of strings, not int"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list of token ids \(ints\), not int"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a list of token ids"),
    (dict(stop=b"x"), "stop must be a string or a list of strings, not bytes"),
    (dict(stop=[5]), r"stop\[0\] must be a non-empty string, not int"),
    (dict(stop_token_ids=[1.0]), r"stop_token_ids\[0\] must be an int"),
])
def test_stop_fields_of_the_wrong_type_name_the_field(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


def test_stop_fields_accept_one_string_none_and_sequences():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == [0, 1]


# ---- verify(): edits after construction, token ids against the vocabulary ----------------------


@pytest.mark.parametrize("field_name,value,exc,match", [
    ("n", 0, ValueError, "n must be"), ("temperature", -1.0, ValueError, "temperature must be >= 0"),
    ("top_p", 0.0, ValueError, "top_p must be in"), ("max_tokens", 0, ValueError, "max_tokens must be"),
    ("stop", 5, TypeError, "stop must be a string"), ("stop_token_ids", [-1], ValueError, r"stop_token_ids\[0\]"),
    ("ignore_eos", "yes", TypeError, "ignore_eos must be a bool"), ("min_tokens", 99, ValueError, "min_tokens"),
    ("repetition_penalty", 1e-45, ValueError, "repetition_penalty"), ("seed", 1.5, TypeError, "seed must be an int"),
])
def test_verify_rechecks_fields_edited_after_construction(field_name, value, exc, match):
    sp = SamplingParams()
    setattr(sp, field_name, value)  # dataclasses do not check assignments: verify() must
    with pytest.raises(exc, match=match):
        sp.verify()


def test_verify_normalises_like_the_constructor():
    sp = SamplingParams()
    sp.stop, sp.temperature = "end", 1e-40
    sp.verify()
    assert sp.stop == ["end"] and sp.temperature == 0.0 and sp.greedy
    SamplingParams().verify(vocab_size=V)  # the defaults pass


def test_verify_checks_token_ids_against_the_vocabulary():
    sp = SamplingParams(stop_token_ids=[2, 128009])  # a Llama-3 id on SmolLM2's 49152-token vocabulary
    sp.verify()  # without a vocabulary the id is only checked to be a non-negative int
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] must be a token id in \[0, 49152\).*got 128009"):
        sp.verify(vocab_size=49152)
    SamplingParams(stop_token_ids=[0, 49151]).verify(49152)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] must be a token id in \[0, 49152\)"):
        SamplingParams(stop_token_ids=[49152]).verify(49152)
    with pytest.raises(ValueError, match="vocab_size must be"):
        SamplingParams().verify(vocab_size=0)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        SamplingParams().verify(vocab_size=49152.0)


def test_sampler_guard_row_penalised_to_all_minus_inf_uses_the_raw_argmax():
    """Every token seen and negative, the largest penalty float32 holds: logits x 3e38 are all -inf; the
    row falls back to the model's own argmax (token 1), not to token 0."""
    logits = torch.tensor([-5.0, -4.0, -10.0, -6.0])
    for t in (0.0, 1.0):
        assert _one_row(SamplingParams(repetition_penalty=3e38, temperature=t), logits, prompts=[[0, 1, 2, 3]]) == 1
