"""AWQ and GPTQ (layers/quantization/awq.py, gptq.py): oracles on fresh random inputs and on the model.

- GPTQ's column update against Optimal Brain Surgeon's plain formula (the explicit inverse of the
  Hessian of the columns not yet rounded), step by step; the blocked, lazy GPTQ against that
  plain sequential loop, bit for bit in the levels it picks.
- AWQ's scale search against a brute-force loop over the same grid; the folds leave the
  full-precision model's output unchanged.
- Each method's layer output SQNR vs the full-precision layer, on held-out inputs drawn like the
  calibration inputs, beats round-to-nearest on the same layer.
- The embedded SmolLM2's first four decoder layers quantized by AWQ and GPTQ (group 64): each layer's
  output SQNR on held-out text above RTN's, and perplexity on a held-out slice no worse than RTN's
  (minutes on a CPU: run with MINILLM_SLOW_QUANT=1, or on a GPU machine).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_corpus import corpus  # noqa: F401  (fixture)

from minillm.kernels.w4a16 import dequantize_int4
from minillm.layers.quantization.calibration import dequantize_grid, grid_params, quantize_to_grid
from minillm.layers.quantization.gptq import column_update, gptq_quantize, hessian, inverse_cholesky
from minillm.layers.quantization.utils import quantize_int4, sqnr


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


def correlated_inputs(g, T: int, K: int, mix: torch.Tensor, salient: torch.Tensor) -> torch.Tensor:
    """Activations like a transformer's: correlated channels (a random mixing) and a few channels
    much larger than the rest (the 'salient' ones AWQ protects)."""
    z = torch.randn(T, K, generator=g)
    return (z @ mix) * salient  # [T, K]


def _layer(g, N=96, K=256):
    w = torch.randn(N, K, generator=g) * 0.05
    mix = torch.eye(K) + torch.randn(K, K, generator=g) / K ** 0.5  # strongly correlated channels
    salient = torch.ones(K)
    salient[torch.randperm(K, generator=g)[:K // 32]] = 20.0
    return w, mix, salient


def _rtn(w, group_size):
    return dequantize_int4(*quantize_int4(w, group_size), group_size, torch.float32)


# ---- GPTQ ------------------------------------------------------------------------------------------


def obs_reference(w: torch.Tensor, H: torch.Tensor, group_size: int, damp: float) -> torch.Tensor:
    """Plain GPTQ/OBS: round columns left to right; after each, move the remaining columns by
    -(w_i - q_i) / [H_F^-1]_ii * [H_F^-1]_i,F with the explicit inverse over the remaining set F.
    Returns the levels q [N, K] (float)."""
    W = w.double().clone()
    Hd = H.double().clone()
    Hd.diagonal().add_(damp * Hd.diagonal().mean())
    N, K = W.shape
    Q = torch.zeros(N, K, dtype=torch.float64)
    for i in range(K):
        if i % group_size == 0:
            cols = W[:, i:i + group_size].float()
            scales, mins = grid_params(cols.amin(1), cols.amax(1), torch.float32)
        q = quantize_to_grid(W[:, i].float(), scales, mins)
        Q[:, i] = q.double()
        Finv = torch.linalg.inv(Hd[i:, i:])  # [K - i, K - i]
        err = (W[:, i] - dequantize_grid(q, scales, mins).double()) / Finv[0, 0]
        W[:, i:] -= err[:, None] * Finv[0][None, :]
    return Q


def test_column_update_is_obs_formula(g):
    N, K = 8, 24
    w = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = torch.randn(64, K, generator=g, dtype=torch.float64)
    H = 2 * x.T @ x / 64
    U = inverse_cholesky(H, 0.01)
    Hd = H.clone()
    Hd.diagonal().add_(0.01 * H.diagonal().mean())
    W = w.clone()
    for i in range(K):  # each step against the explicit inverse of the remaining columns' Hessian
        wq = torch.round(W[:, i] * 4) / 4
        expected = W[:, i:] - ((W[:, i] - wq) / torch.linalg.inv(Hd[i:, i:])[0, 0])[:, None] * \
            torch.linalg.inv(Hd[i:, i:])[0][None, :]
        column_update(W, U, i, wq)
        torch.testing.assert_close(W[:, i:], expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(W[:, i], wq, rtol=0, atol=1e-12)  # column i lands on its rounded value


def test_gptq_blocked_equals_plain_loop(g):
    w, mix, salient = _layer(g, N=16, K=128)
    H = hessian(correlated_inputs(g, 512, 128, mix, salient)).double()
    ref = obs_reference(w, H, 32, 0.01)
    out = gptq_quantize(w, H.float(), 32, damp=0.01, block_size=64)
    from minillm.kernels.w4a16 import unpack_int4

    levels = unpack_int4(out["qweight"]).double()
    # fp32 (blocked) vs fp64 (plain): a level may differ where a weight sits on a rounding boundary
    assert (levels != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_beats_rtn_on_layer_output(g, act_order, group_size):
    w, mix, salient = _layer(g)
    x_cal = correlated_inputs(g, 2048, w.shape[1], mix, salient)
    x_test = correlated_inputs(g, 1024, w.shape[1], mix, salient)  # held out, drawn the same way
    out = gptq_quantize(w, hessian(x_cal), group_size, act_order=act_order)
    wq = dequantize_int4(out["qweight"], out["scales"], out["mins"], group_size, torch.float32)
    ref = x_test @ w.T
    s_gptq, s_rtn = sqnr(ref, x_test @ wq.T), sqnr(ref, x_test @ _rtn(w, group_size).T)
    assert s_gptq > s_rtn + 0.5, (s_gptq, s_rtn)  # measured: +1.4..2.6 dB, +2..5 with act_order


def test_gptq_dead_inputs_and_bad_arguments(g):
    w = torch.randn(8, 64, generator=g)
    x = torch.randn(100, 64, generator=g)
    x[:, 5] = 0  # an input that never fires: its weights can be anything; GPTQ sets them to the grid near 0
    out = gptq_quantize(w, hessian(x), 32)
    wq = dequantize_int4(out["qweight"], out["scales"], out["mins"], 32, torch.float32)
    assert torch.isfinite(wq).all()
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(w, hessian(x), 48)
    from minillm.layers.quantization.gptq import GPTQConfig

    for bad, match in [(dict(group_size=48), "group_size"), (dict(damp=0), "damp"), (dict(act_order=1), "act_order"),
                       (dict(block_size=96, group_size=64), "block_size"), (dict(num_sequences=0), "num_sequences"),
                       (dict(path=3), "path")]:
        with pytest.raises(ValueError, match=match):
            GPTQConfig(**bad)


# ---- AWQ -------------------------------------------------------------------------------------------


def test_scale_search_is_brute_force(g):
    from minillm.layers.quantization.awq import ALPHAS, search_scale

    w, mix, salient = _layer(g, N=32, K=128)
    x = correlated_inputs(g, 256, 128, mix, salient)
    s, alpha, errors = search_scale(x, w, 64)
    x_mean = x.abs().mean(0)
    brute = []
    for a in ALPHAS:  # the same objective written out: scale, round to nearest, unscale, compare outputs
        sa = x_mean.clamp_min(1e-4) ** a
        sa = sa / (sa.max() * sa.min()).sqrt()
        brute.append(((x @ (_rtn(w * sa, 64) / sa).T - x @ w.T) ** 2).mean().item())
    torch.testing.assert_close(torch.tensor(errors), torch.tensor(brute), rtol=1e-4, atol=0)
    assert alpha == ALPHAS[min(range(len(brute)), key=brute.__getitem__)]
    assert errors[ALPHAS.index(alpha)] <= errors[0]  # alpha = 0 is RTN: the search never loses to it
    assert (s.max() * s.min()).item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_beats_rtn_on_layer_output(g, group_size):
    from minillm.layers.quantization.awq import search_clip, search_scale
    from minillm.layers.quantization.calibration import quantize_with_range

    w, mix, salient = _layer(g)
    x_cal = correlated_inputs(g, 512, w.shape[1], mix, salient)
    x_test = correlated_inputs(g, 1024, w.shape[1], mix, salient)
    s, _, _ = search_scale(x_cal, w, group_size)
    lo, hi = search_clip(x_cal / s, w * s, group_size)
    out = quantize_with_range(w * s, group_size, lo, hi, torch.float32)
    wq = dequantize_int4(out["qweight"], out["scales"], out["mins"], group_size, torch.float32) / s
    ref = x_test @ w.T
    s_awq, s_rtn = sqnr(ref, x_test @ wq.T), sqnr(ref, x_test @ _rtn(w, group_size).T)
    assert s_awq > s_rtn + 0.5, (s_awq, s_rtn)


def test_clip_search_never_worse_than_no_clip(g):
    from minillm.layers.quantization.awq import search_clip
    from minillm.layers.quantization.calibration import group_range, quantize_with_range

    w = torch.randn(40, 128, generator=g)
    x = torch.randn(200, 128, generator=g)
    lo, hi = search_clip(x, w, 32)
    assert (lo >= group_range(w, 32)[0]).all() and (hi <= group_range(w, 32)[1]).all()

    def err(lo, hi):
        t = quantize_with_range(w, 32, lo, hi, torch.float32)
        return ((x @ (w - dequantize_int4(t["qweight"], t["scales"], t["mins"], 32, torch.float32)).T) ** 2).sum()

    assert err(lo, hi) <= err(*group_range(w, 32)) * (1 + 1e-5)
    assert ((lo != group_range(w, 32)[0]) | (hi != group_range(w, 32)[1])).any()  # some groups were clipped


def test_folds_leave_the_block_unchanged(tmp_path, g):
    """Scaling a block's layers and folding 1/s into norms, v rows and up rows is exact in full precision
    (a GQA model with biases: each fold touches the bias rows too)."""
    from tiny_models import make_tiny

    from minillm.layers import AttentionMetadata
    from minillm.layers.quantization.awq import _gqa_tie, fold_scales
    from minillm.layers.quantization.calibration import block_linears
    from minillm.loader import load_model

    model, _, _ = load_model(make_tiny("llama3", tmp_path / "m"), dtype=torch.float64)
    block = model.model.layers[0]
    attn = block.self_attn
    tie, rep = _gqa_tie(attn.num_heads, attn.num_kv_heads, attn.head_dim)
    assert rep == 2
    scales = {name: torch.rand(layer.weight.shape[1], generator=g, dtype=torch.float64) * 4 + 0.25
              for name, layer in block_linears(block).items()}
    scales["o_proj"] = tie(scales["o_proj"])  # the o_proj scale must be shared within a KV group
    T = 9
    x = torch.randn(T, model.config.hidden_size, generator=g, dtype=torch.float64)
    pos, meta = torch.arange(T), AttentionMetadata.from_seq_lens([T])
    cos_sin = model.model.rotary_emb.cos_sin(pos, x.dtype)
    with torch.no_grad():
        before = block(pos, x, None, meta, cos_sin)
        fold_scales(block, scales)
        after = block(pos, x, None, meta, cos_sin)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---- lab 08: the solution passes its checks, classic slips fail --------------------------------------


@pytest.mark.slow
def test_lab08_checks_pass_the_solution_and_catch_slips():
    from test_labs_engine import fails, solution

    from minillm.labs import ch08

    lab = solution("08_quantization")
    assert ch08.check_group_quantize(lab["group_quantize"], cases=30).passed
    assert ch08.check_group_dequantize(lab["group_dequantize"], cases=30).passed
    assert ch08.check_awq_scale(lab["awq_scale"], cases=5).passed
    assert ch08.check_gptq_update(lab["gptq_update"], cases=30).passed

    def sixteen_levels(w, G):  # (max - min) / 16: a step too small, the top level never used
        _, s, m = lab["group_quantize"](w, G)
        return torch.round((w.view(*s.shape, G) - m[..., None]) / (s * 15 / 16)[..., None]).clamp(0, 15).view(
            w.shape).long(), s * 15 / 16, m

    def no_min(q, s, m, G):
        return lab["group_dequantize"](q, s, torch.zeros_like(m), G)

    def unnormalized(x, w, G):  # s = mean|x|^alpha without the sqrt(max * min) normalization
        _, alpha = lab["awq_scale"](x, w, G)
        x_mean = x.abs().mean(0).clamp_min(1e-4)
        return x_mean ** alpha, alpha

    def only_later_columns(W, U, i, wq):  # forgets that column i itself lands on wq
        err = (W[:, i] - wq) / U[i, i]
        W = W.clone()
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
        return W, err

    fails(ch08.check_group_quantize, sixteen_levels, cases=30)
    fails(ch08.check_group_dequantize, no_min, cases=30)
    fails(ch08.check_awq_scale, unnormalized, cases=10)
    fails(ch08.check_gptq_update, only_later_columns, cases=30)


# ---- the embedded SmolLM2: real weights, real text -------------------------------------------------

NUM_BLOCKS = 4  # the first decoder layers are quantized (the rest stay fp32)
# Calibrating even four of SmolLM2's layers takes minutes on a CI CPU (AWQ's searches, GPTQ's column
# loop): these run where MINILLM_SLOW_QUANT=1 is set or on a GPU machine (the chapter's GPU script
# sets it); elsewhere they skip and say so.
slow_quant = pytest.mark.skipif(not (os.environ.get("MINILLM_SLOW_QUANT") or torch.cuda.is_available()),
                                reason="embedded-model AWQ/GPTQ calibration takes minutes on a CPU: "
                                       "set MINILLM_SLOW_QUANT=1 (the GPU script does)")


@pytest.fixture(scope="module")
def smollm_quantized(corpus):  # noqa: F811
    """The embedded model in fp32 and three copies whose first NUM_BLOCKS decoder layers are int4 g64:
    by round-to-nearest, AWQ and GPTQ, calibrated on 16 x 128 tokens of the calibration articles.

    GPTQ runs with act_order and damp 0.1 here: with 2,048 calibration tokens for down_proj's 1,536
    inputs, H is barely full rank, and plain-order GPTQ at damp 0.01 fits the calibration text too
    closely (measured on held-out text: block SQNR 22.1 vs RTN's 22.2 at block 0, 12.7 vs 12.7 at
    block 3); act_order + damp 0.1 measured 24.4/23.7/26.1/14.9 dB against RTN's 22.2/19.7/21.2/12.7."""
    import copy

    from minillm.layers.quantization.awq import AWQConfig
    from minillm.layers.quantization.calibration import (
        block_linears,
        calibrate_blockwise,
        calibration_ids,
    )
    from minillm.layers.quantization.gptq import GPTQConfig
    from minillm.layers.quantization.int4 import become_int4
    from minillm.loader import load_model

    base, config, tok = load_model(None)

    def rtn(block, inputs):
        for layer in block_linears(block).values():
            qweight, scales, mins = quantize_int4(layer.weight.data, 64)
            become_int4(layer, {"qweight": qweight, "scales": scales, "mins": mins}, 64)

    seqs = calibration_ids(tok, config.vocab_size, 16, 128)
    models = {"fp32": base}
    for name, fn in (("rtn", rtn), ("awq", AWQConfig(group_size=64, max_rows=256).quantize_block),
                     ("gptq", GPTQConfig(group_size=64, damp=0.1, act_order=True).quantize_block)):
        models[name] = copy.deepcopy(base)
        calibrate_blockwise(models[name], seqs, fn, name, num_blocks=NUM_BLOCKS)
    return models, tok.encode(corpus.eval_text())


@slow_quant
def test_embedded_model_blocks_sqnr_beats_rtn(smollm_quantized):
    """Each quantized decoder layer's contribution to the residual stream (attention and MLP outputs),
    on held-out text fed by the fp32 model, against the fp32 layer's: AWQ and GPTQ above RTN."""
    from minillm.layers import AttentionMetadata

    models, ids = smollm_quantized
    base = models["fp32"]
    ids = ids[1000:1256]  # held-out tokens (the eval split), not the perplexity slice below
    seen = []
    hooks = [b.register_forward_pre_hook(lambda _m, args: seen.append(args)) for b in base.model.layers[:NUM_BLOCKS]]
    meta = AttentionMetadata.from_seq_lens([len(ids)])
    with torch.inference_mode():
        base(torch.tensor(ids), torch.arange(len(ids)), meta)
    for h in hooks:
        h.remove()
    def contributions(model, i, args):
        x, residual = args[1], args[2]
        stream = x if residual is None else x + residual
        out, res = model.model.layers[i](*args)
        return torch.cat([res - stream, out], dim=-1)  # [T, 2 * hidden]: attention's and the MLP's outputs

    for i, args in enumerate(seen):
        with torch.inference_mode():
            ref = contributions(base, i, args)
            s = {name: sqnr(ref, contributions(models[name], i, args)) for name in ("rtn", "awq", "gptq")}
        print(i, {k: round(v, 2) for k, v in s.items()})
        assert s["awq"] > s["rtn"] and s["gptq"] > s["rtn"], (i, s)


@slow_quant
def test_embedded_model_perplexity_awq_gptq_not_worse_than_rtn(smollm_quantized):
    from minillm.eval import perplexity

    models, ids = smollm_quantized
    ppl = {name: perplexity(m, ids[:512], context_len=256, stride=256, use_tqdm=False).perplexity
           for name, m in models.items()}
    print({k: round(v, 3) for k, v in ppl.items()})
    assert ppl["rtn"] > ppl["fp32"]  # four rounded layers cost something measurable
    assert ppl["awq"] <= ppl["rtn"] and ppl["gptq"] <= ppl["rtn"], ppl
