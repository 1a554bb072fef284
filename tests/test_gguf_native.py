"""quantization="gguf": a GGUF file's Q4_1 and Q8_0 blocks kept packed and multiplied by the W4A16/W8A16
kernels. Oracles: the `gguf` package's own dequantizer (bit for bit), the dequantize-then-matmul
reference (the kernels, under the interpreter here and natively on a GPU), and the embedded model
loaded the usual way (dequantized at load): the same logits up to matmul rounding, the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.kernels.w4a16 import dequantize_int4, dequantize_int8, w4a16_gemm, w8a16_gemm, w8a16_gemm_ref
from minillm.layers import AttentionMetadata
from minillm.layers.quantization.gguf import GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod
from minillm.layers.quantization.utils import parameter_bytes
from minillm.loader import load_model
from minillm.loader.dequant import dequantize, repack
from minillm.model_files import resolve_source


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


KINDS = {"Q4_1": GGMLQuantizationType.Q4_1, "Q8_0": GGMLQuantizationType.Q8_0}


def _packed_dequantized(packed: dict, kind: str, dtype=torch.float32) -> torch.Tensor:
    if kind == "Q4_1":
        return dequantize_int4(packed["qweight"], packed["scales"], packed["mins"], 32, dtype)
    return dequantize_int8(packed["qweight"], packed["scales"], dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_dequantize_bit_exactly_as_gguf(kind, seed):
    """Fresh random rows (each with its own range, some constant), quantized by the gguf package: our
    repacked tensors and our load-time dequantizer both give gguf's dequantized values, bit for bit."""
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 40)), 32 * int(rng.integers(1, 9))
    x = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 5, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.7  # a constant block: scale 0
    raw = gguf_quantize(x, KINDS[kind])  # [rows, bytes per row] uint8
    want = gguf_dequantize(raw, KINDS[kind])  # [rows, cols] float32
    packed = repack(torch.from_numpy(raw.copy()), kind, (rows, cols))
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (rows, cols // 32)
    assert np.array_equal(_packed_dequantized(packed, kind).numpy(), want)
    assert np.array_equal(dequantize(torch.from_numpy(raw.copy()), kind, (rows, cols)).numpy(), want)


def test_the_embedded_files_tensors_repack_bit_exactly():
    from minillm.gguf_meta import open_gguf

    seen = set()
    for t in open_gguf(resolve_source(None)).tensors:
        kind = t.tensor_type.name
        if kind in KINDS and kind not in seen and len(t.shape) == 2:
            seen.add(kind)
            raw = np.asarray(t.data)
            shape = tuple(int(s) for s in reversed(t.shape))
            got = _packed_dequantized(repack(torch.from_numpy(raw.copy()), kind, shape), kind).numpy()
            assert np.array_equal(got, gguf_dequantize(raw, KINDS[kind]).reshape(shape)), t.name
    assert seen == set(KINDS)


def _grouped_int8(g, N, K):
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).half()
    return q, s


@pytest.mark.parametrize("M", [1, 3, 16, 33])
def test_group_scaled_int8_kernel_matches_its_reference(M, g):
    """Q8_0's layout through the W8A16 kernel (scales per 32 inputs): against dequantize-then-matmul."""
    N, K = 45, 96
    q, s = _grouped_int8(g, N, K)
    x = torch.randn(M, K, generator=g)
    if torch.cuda.is_available():  # natively there; under the interpreter on a CPU
        q, s, x = q.cuda(), s.cuda(), x.cuda()
    want = x.double() @ dequantize_int8(q, s, torch.float64).T
    for split_k in (None, 1, 3):
        got = w8a16_gemm(x, q, s, 32, split_k=split_k)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w8a16_gemm_ref(x.cpu(), q.cpu(), s.cpu(), 32).double(), want.cpu(), rtol=1e-4, atol=1e-4)


def test_group_scaled_int8_bad_input(g):
    q, s = _grouped_int8(g, 8, 64)
    x = torch.randn(2, 64, generator=g)
    with pytest.raises(ValueError, match=r"scales must have shape \[8, 2\]"):
        w8a16_gemm(x, q, s[:, :1], 32)
    with pytest.raises(ValueError, match="int8 group_size must be a multiple of 32"):
        w8a16_gemm(x, q, s, 48)


# ---- the embedded model ------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was", "Water boils at"]


@pytest.fixture(scope="module")
def both():
    return LLM(dtype="float32", device="cpu"), LLM(dtype="float32", device="cpu", quantization="gguf")


def _logits(model, ids: list[int]) -> torch.Tensor:
    dev = model.lm_head.qweight.device if hasattr(model.lm_head, "qweight") else model.lm_head.weight.device
    meta = AttentionMetadata.from_seq_lens([len(ids)], device=dev)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), meta))


@pytest.mark.slow
def test_embedded_model_stays_packed_and_in_its_files_size(both):
    dense, packed = both
    layers = packed.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    assert layers[0].mlp.down_proj.qweight.dtype == torch.uint8 and "weight" not in layers[0].mlp.down_proj._parameters
    embed = packed.model.model.embed_tokens
    assert isinstance(embed.quant_method, GGUFEmbeddingMethod) and embed.qweight.dtype == torch.int8  # Q8_0
    assert packed.model.lm_head.qweight is embed.qweight  # tied: one packed table
    file_bytes = resolve_source(None).stat().st_size
    got = parameter_bytes(packed.model)["total"]
    assert 0.95 * file_bytes < got < 1.0 * file_bytes  # the file is its tensors plus a little metadata
    assert parameter_bytes(dense.model)["total"] / got > 5  # fp32 here; bf16 would be > 2.7x


@pytest.mark.slow
def test_embedded_model_logits_and_greedy_tokens_match_the_dequantized_path(both):
    """Same weights, so in fp32 the logits differ only by matmul summation order; greedy tokens for
    32 steps are identical, batched through the engine."""
    dense, packed = both
    ids = [dense.tokenizer.encode(p) for p in PROMPTS]
    for p in ids[:2]:
        torch.testing.assert_close(_logits(packed.model, p), _logits(dense.model, p), rtol=1e-4, atol=1e-3)
    greedy = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = [{"prompt_token_ids": p} for p in ids]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy, use_tqdm=False)]
    assert got == want


def test_gguf_needs_a_gguf_file(tmp_path):
    tiny = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64)
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf file's weights"):
        load_model(tiny, load_format="dummy", quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf' has no option 'bits'"):
        load_model(None, quantization={"method": "gguf", "bits": 4})
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        GGUFConfig().get_quant_method(torch.nn.Linear(2, 2), "x")


# ---- on a GPU: the kernels natively, bf16 -------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the native kernels)")
def test_embedded_model_on_gpu_bf16_packed_vs_dequantized():
    """bf16 on the GPU, CUDA graphs on: the packed model's greedy tokens equal the dequantized model's
    for most of 32 steps on every prompt (bf16 rounding differs: the kernels round the weight tile
    to bf16 as the dequantized copy does, but sum in a different order), and its logits stay close."""
    dense = LLM(device="cuda", dtype="bfloat16", num_gpu_blocks=256)
    packed = LLM(device="cuda", dtype="bfloat16", quantization="gguf", num_gpu_blocks=256)
    ids = [dense.tokenizer.encode(p) for p in PROMPTS]
    for p in ids:
        a, b = _logits(dense.model, p), _logits(packed.model, p)
        assert (a - b).norm() / a.norm() < 0.03
    greedy = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = [{"prompt_token_ids": p} for p in ids]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy, use_tqdm=False)]
    same = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32) for a, b in zip(got, want))
    assert same >= 0.75 * 32 * len(PROMPTS), (got, want)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the native kernels)")
@pytest.mark.parametrize("M", [1, 16, 128])
def test_packed_kernels_natively_on_real_shapes(M, g):
    """bf16 outputs of ~30 round in steps of 0.125-0.25: compare by the error's norm (an fp32-accumulated
    product rounded once to bf16 is within ~0.3 %; a wrong group scale or nibble is tens of %)."""
    N, K = 1536, 576  # SmolLM2's gate_up and hidden sizes
    x = torch.randn(M, K, generator=g).cuda().bfloat16()
    q, s = (t.cuda() for t in _grouped_int8(g, N, K))
    want = x.float() @ dequantize_int8(q, s, torch.bfloat16).float().T
    assert _rel_err(w8a16_gemm(x, q, s, 32), want) < 5e-3
    q4 = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8).cuda()
    s4 = (torch.rand(N, K // 32, generator=g) * 0.01).half().cuda()
    m4 = (-torch.rand(N, K // 32, generator=g) * 0.08).half().cuda()
    want = x.float() @ dequantize_int4(q4, s4, m4, 32, torch.bfloat16).float().T
    assert _rel_err(w4a16_gemm(x, q4, s4, m4, 32), want) < 5e-3


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 32), (8, None)])
def test_prefill_path_dequantizes_exactly_then_multiplies(bits, group, g):
    """M > 16 without split_k: the weight is dequantized by one kernel (bit for bit the reference's
    weight) and multiplied by torch; odd N and a short last K tile included."""
    from minillm.kernels.wna16_dequant import dequantize_weight

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    N, K, M = 37, 160 if group != 128 else 256, 40
    if bits == 4:
        q = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        s = torch.rand(N, K // group, generator=g) * 0.1
        m = -torch.rand(N, K // group, generator=g)
        want_w = dequantize_int4(q, s, m, group, torch.float32)
    else:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = torch.rand(N, generator=g) * 0.1 if group is None else torch.rand(N, K // group, generator=g) * 0.1
        m = None
        want_w = dequantize_int8(q, s, torch.float32)
    q, s = q.to(dev), s.to(dev)
    m = m.to(dev) if m is not None else None
    w = dequantize_weight(q, s, m, group or 128, bits, torch.float32)
    assert torch.equal(w.cpu(), want_w)
    x = torch.randn(M, K, generator=g).to(dev)
    y = w4a16_gemm(x, q, s, m, group) if bits == 4 else w8a16_gemm(x, q, s, group)
    torch.testing.assert_close(y.cpu(), x.cpu() @ want_w.T, rtol=1e-4, atol=1e-4)
