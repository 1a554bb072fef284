"""The int8 vocabulary table (layers/quantization/lm_head.py): the LM head's logits and a tied
embedding's lookups from one int8 copy, per-row scales; on by default with every weight-only method.

Oracles, on fresh random inputs (seeded by the run's seed):
  - the method against plain PyTorch with its own dequantized table: a lookup is the same rows bit for
    bit (both compute q * s in fp32 and round once); the logits are a K-term fp32 dot product, within
    K * eps * |x| @ |W|^T of the exact one (the classic bound, whatever the summation order);
  - against the full-precision table: int8 rounding moves a weight by at most half its row's step
    s_v = max|W[v]| / 127, so a logit moves by at most s_v / 2 * sum_k |x_k| (plus the fp32 bound);
  - tensor parallelism: each rank quantizes its whole rows, so the ranks' logits are the one-rank ones;
  - a tiny random Llama (int8, int4; tied and untied): the head's bytes, lm_head="none". The engine's
    batched = alone oracle with the quantized head (tied and untied) is test_quantization.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quantization import TINY, TINY_TIED, _logits, twins

from minillm.distributed import simulate_tensor_parallel
from minillm.kernels.w4a16 import dequantize_int8
from minillm.layers import AttentionMetadata, ParallelLMHead, VocabParallelEmbedding
from minillm.layers.backend import kernel_mode
from minillm.layers.quantization import get_quantization_config
from minillm.layers.quantization.lm_head import Int8EmbeddingMethod
from minillm.loader import default_dtype, load_model

EPS = torch.finfo(torch.float32).eps


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per logit: K * eps * |x| @ |w|^T, what fp32 summation (any order) may move a K-term dot product."""
    return x.shape[-1] * EPS * (x.double().abs() @ w.double().abs().T) + 1e-30


def quantized_head(table: torch.Tensor, tied: bool, qc=None):
    """(embedding, LM head) holding `table` [V, H], loaded through weight_loader and quantized."""
    qc = qc or get_quantization_config("int8")
    V, H = table.shape
    embed, head = VocabParallelEmbedding(V, H, qc, "model.embed_tokens"), ParallelLMHead(V, H, qc, "lm_head")
    embed.weight_loader(embed.weight, table)
    if tied:
        head.tie_weights(embed)
    else:
        head.weight_loader(head.weight, table)
    for layer in (embed, head):  # the loader's order: model.embed_tokens before lm_head
        layer.quant_method.process_weights_after_loading(layer)
    return embed, head


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_lookups_against_the_dequantized_and_the_full_table(tied, g):
    V, H = 97, 64
    # rows of different magnitudes (a per-row scale each), one all-zero row (scale 0: q = 0)
    table = torch.randn(V, H, generator=g) * torch.rand(V, 1, generator=g).mul(4).exp2()
    table[5] = 0
    embed, head = quantized_head(table, tied)
    assert isinstance(head.quant_method, Int8EmbeddingMethod) and "weight" not in dict(head.named_parameters())
    assert head.qweight.dtype == torch.int8 and head.qweight.shape == (V, H) and head.scales.shape == (V,)
    deq = dequantize_int8(head.qweight, head.scales)  # [V, H] the table the int8 copy stands for
    step = table.abs().amax(dim=1) / 127  # [V] each row's step

    # the table itself: half a step per weight at most
    assert ((table - deq).abs() <= step[:, None] / 2 * (1 + 1e-6)).all()
    assert (head.qweight[5] == 0).all() and (deq[5] == 0).all()

    x = torch.randn(7, H, generator=g)
    logits = head.compute_logits(x)  # [7, V]
    assert logits.shape == (7, V) and logits.dtype == torch.float32
    exact = x.double() @ deq.double().T  # [7, V]
    assert ((logits.double() - exact).abs() <= fp32_bound(x, deq)).all()
    full = x.double() @ table.double().T
    rounding = step.double()[None, :] / 2 * x.double().abs().sum(dim=1, keepdim=True)  # [7, V]
    assert ((logits.double() - full).abs() <= rounding * (1 + 1e-6) + fp32_bound(x, deq)).all()

    ids = torch.randint(0, V, (50,), generator=g)
    ids[:3] = torch.tensor([0, V - 1, 5])
    rows = embed(ids)  # [50, H]
    if tied:  # the lookup reads the same int8 tensors: exactly the dequantized rows
        assert embed.qweight is head.qweight and embed.scales is head.scales
        assert "weight" not in dict(embed.named_parameters())
        torch.testing.assert_close(rows, deq[ids], rtol=0, atol=0)
    else:  # an untied input table stays as loaded: exact lookups
        assert embed.weight.dtype == torch.float32 and not hasattr(embed, "qweight")
        torch.testing.assert_close(rows, table[ids], rtol=0, atol=0)


def test_bf16_table_lookup_rounds_once(g):
    """In bf16 the scales are bf16 and a looked-up row is q * s computed in fp32, rounded once: the same
    bits as the dequantized table's rows, and the logits are the reference's F.linear."""
    table = torch.randn(61, 32, generator=g).to(torch.bfloat16)
    with default_dtype(torch.bfloat16):  # the layers' parameters take the default dtype, as the loader builds them
        embed, head = quantized_head(table, tied=True)
    assert head.scales.dtype == torch.bfloat16
    deq = dequantize_int8(head.qweight, head.scales)  # bf16
    ids = torch.randint(0, 61, (20,), generator=g)
    assert torch.equal(embed(ids), deq[ids])
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    assert torch.equal(head.compute_logits(x), F.linear(x, deq))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_the_head_runs_the_w8a16_kernel_when_asked(g):
    """kernel_mode("triton"): the W8A16 kernel (Triton's interpreter on a CPU), fp32 logits within the
    fp32 bound of the reference's."""
    table = torch.randn(97, 64, generator=g) * 0.1
    _, head = quantized_head(table, tied=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    head = head.to(dev)
    x = torch.randn(5, 64, generator=g).to(dev)
    with kernel_mode("torch"):
        want = head.compute_logits(x)
    with kernel_mode("triton"):
        got = head.compute_logits(x)
    deq = dequantize_int8(head.qweight, head.scales)
    assert ((got.double() - want.double()).abs() <= 2 * fp32_bound(x, deq) + EPS * want.double().abs()).all()


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_ranks_quantize_their_own_rows(tp, tied, g):
    """Each rank holds whole rows, so its scales are the one-rank scales of those rows: the ranks'
    logits, concatenated, are the one-rank logits (the same dot products), and their lookups sum to
    the one-rank lookups; the overhang rows (zeros) stay zeros."""
    V, H = 37, 32
    table, x = torch.randn(V, H, generator=g), torch.randn(4, H, generator=g)
    ids = torch.randint(0, V, (30,), generator=g)
    embed1, head1 = quantized_head(table, tied)
    per_rank = -(-V // tp)
    parts, rows = [], torch.zeros(len(ids), H)
    for r in range(tp):
        with simulate_tensor_parallel(r, tp):
            embed, head = quantized_head(table, tied)
            mine = slice(r * per_rank, min((r + 1) * per_rank, V))
            n = mine.stop - mine.start
            assert torch.equal(head.qweight[:n], head1.qweight[mine]) and torch.equal(head.scales[:n], head1.scales[mine])
            assert (head.qweight[n:] == 0).all()  # the overhang: zeros, scale 0
            parts.append(head.compute_logits(x))  # [4, ceil(V / tp)]: this rank's columns
            rows += embed(ids)  # zeros for the ids outside this rank's rows
    logits = torch.cat(parts, -1)
    deq = dequantize_int8(head1.qweight, head1.scales)
    # the same dot products, maybe summed in another order by a GEMM of another width
    assert ((logits[:, :V].double() - head1.compute_logits(x).double()).abs() <= 2 * fp32_bound(x, deq)).all()
    assert (logits[:, V:] == 0).all()
    assert torch.equal(rows, embed1(ids))  # one nonzero term per element: exact


# ---- configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "int4", "awq", "gptq", "fp8"])
def test_every_weight_only_config_gives_the_tables_int8_unless_none(method):
    embed = VocabParallelEmbedding(64, 32)  # a layer to ask about; its own method is the unquantized one
    cfg = get_quantization_config(method)
    assert cfg.lm_head == "int8" and isinstance(cfg.get_quant_method(embed, "lm_head"), Int8EmbeddingMethod)
    cfg = get_quantization_config({"method": method, "lm_head": "none"})
    assert cfg.lm_head == "none" and cfg.get_quant_method(embed, "lm_head") is None
    assert "lm_head='none'" in repr(cfg)


@pytest.mark.parametrize("value", ["fp8", "int4", None, True, "NONE"])
def test_a_bad_lm_head_value_is_a_clear_error(value):
    match = f"quantization 'int4' lm_head must be one of 'int8', 'none', not {value!r}"
    with pytest.raises(ValueError, match=match):
        get_quantization_config({"method": "int4", "lm_head": value})
    with pytest.raises(ValueError, match="lm_head must be one of 'int8', 'none'"):  # before anything loads
        load_model("no/such/model", quantization={"method": "int8", "lm_head": value})


def test_gguf_keeps_its_own_tables():
    with pytest.raises(ValueError, match=r"'gguf' has no option 'lm_head'"):
        get_quantization_config({"method": "gguf", "lm_head": "none"})


# ---- a tiny random Llama ---------------------------------------------------------------------------


def _head_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.lm_head.parameters())


@pytest.mark.parametrize("spec", ["int8", {"method": "int4", "group_size": 64}], ids=["int8", "int4"])
@pytest.mark.parametrize("config", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_tiny_llama_head_is_int8_by_default(spec, config, seed):
    V, H = config.vocab_size, config.hidden_size
    ref, model = twins(config, spec, seed, std=0.02)
    name = spec if isinstance(spec, str) else spec["method"]
    _, kept = twins(config, {"method": name, **({} if isinstance(spec, str) else spec), "lm_head": "none"}, seed,
                    std=0.02)
    head = model.lm_head
    assert head.qweight.dtype == torch.int8 and head.scales.dtype == torch.float32  # fp32 model: fp32 scales
    assert _head_bytes(model) == V * H + 4 * V and _head_bytes(ref) == 4 * V * H  # 1 byte a weight + a scale a row
    assert kept.lm_head.weight.dtype == torch.float32 and _head_bytes(kept) == 4 * V * H
    emb = model.model.embed_tokens
    if config.tie_word_embeddings:  # one int8 table, counted once
        assert emb.qweight is head.qweight and "weight" not in dict(emb.named_parameters())
        assert sum(p.numel() * p.element_size() for p in model.parameters()) == \
            sum(p.numel() * p.element_size() for p in kept.parameters()) - (4 * V * H - (V * H + 4 * V))
    else:
        assert emb.weight.dtype == torch.float32  # the input table: full precision
    # only the head's rounding separates the two quantized models' logits: within its bound
    ids = list(range(3, 40))
    with_head, without = _logits(model, ids), _logits(kept, ids)
    if not config.tie_word_embeddings:  # the same hidden states: the head's rounding bound holds per logit
        table = ref.lm_head.weight  # [V, H]
        step = table.abs().amax(dim=1) / 127  # [V]
        hidden = _hidden(kept, ids)  # [T, H]
        rounding = step[None, :] / 2 * hidden.abs().sum(dim=1, keepdim=True)  # [T, V]
        slack = 2 * fp32_bound(hidden, table)  # each of the two logits' own fp32 sums
        assert ((with_head - without).abs().double() <= rounding.double() * (1 + 1e-5) + slack).all()
    assert (with_head - without).abs().max() < 0.05 * without.abs().max()


def _hidden(model, ids: list[int]) -> torch.Tensor:
    """The final norm's output [T, hidden]: what the LM head multiplies."""
    meta = AttentionMetadata.from_seq_lens([len(ids)])
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), meta)


def test_tiny_llama_bf16_lm_head_none_keeps_bf16():
    model, _, _ = load_model(TINY_TIED, load_format="dummy", dtype=torch.bfloat16,
                             quantization={"method": "int4", "group_size": 32, "lm_head": "none"})
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    model, _, _ = load_model(TINY_TIED, load_format="dummy", dtype=torch.bfloat16, quantization="int4")
    assert model.lm_head.qweight.dtype == torch.int8 and model.lm_head.scales.dtype == torch.bfloat16
