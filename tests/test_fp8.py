"""FP8 (chapter 08): the activation quantization kernel against PyTorch (interpreter on a CPU,
natively on a GPU), the layers against the full-precision layers (SQNR >= 20 dB), the reference GEMM
against torch._scaled_mm's math, LLM(quantization="fp8"), weight-only where FP8 GEMMs are missing.
The weight-only kernel: test_kernels_w8a16_fp8.py; which path runs at which M: test_fp8_dispatch.py.

On a CPU the layers run the explicit reference (`emulate=True`); torch._scaled_mm itself runs where
PyTorch has it (a CPU build of 2.6+ has a software one; an FP8 GPU), so the reference is held to it.
"""

from __future__ import annotations

import pytest
import torch

from minillm.config import ModelConfig
from minillm.kernels.quant_fp8 import (
    FP8_E4M3_MAX,
    quantize_fp8_ref,
    scaled_fp8_quant,
    scaled_fp8_quant_ref,
)
from minillm.layers import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from minillm.layers.quantization import Fp8Config, get_quantization_config
from minillm.layers.quantization.fp8 import WEIGHT_ONLY_MAX_M, fp8_gemm, fp8_gemm_ref, quantize_weight_fp8
from minillm.layers.quantization.utils import sqnr
from minillm.loader import load_model
from minillm.models.utils import process_weights_after_loading

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FP8_GPU = GPU and torch.cuda.get_device_capability() >= (8, 9)
FP8 = torch.float8_e4m3fn


def has_scaled_mm(device: str) -> bool:
    try:
        one = torch.ones(16, 16, device=device).to(FP8)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones((), device=device), scale_b=torch.ones((), device=device),
                         out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


# ---- the activation quantization kernel ------------------------------------------------------------


@pytest.mark.parametrize("M,K", [(1, 64), (7, 576), (33, 3000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["per_token", "per_tensor", "static"])
def test_activation_quantization_kernel_matches_torch(g, M, K, dtype, mode):
    x = rand(g, M, K, dtype=dtype) * torch.logspace(-3, 2, M, device=DEVICE, dtype=dtype)[:, None]  # rows of every size
    if M > 1:
        x[0] = 0  # an all-zero token still gets a finite scale
    scale = (x.float().abs().amax() / 100).reshape(()) if mode == "static" else None  # saturates the big rows
    kw = dict(scale=scale, per_token=mode == "per_token")
    q, s = scaled_fp8_quant(x, **kw)
    q_ref, s_ref = scaled_fp8_quant_ref(x, **kw)
    assert q.dtype == FP8 and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref) and s.shape == ((M, 1) if mode == "per_token" else ())
    assert torch.isfinite(s).all() and (s > 0).all()
    if mode == "per_token":  # each row's largest value lands on 448, and the rest within fp8's 2^-4 step
        assert (q.float().abs().amax(dim=1)[1:] == FP8_E4M3_MAX).all()
        back = q.float() * s
        assert ((back - x.float()).abs() <= x.float().abs() * 2**-4 + s * 2**-9).all()


def test_every_fp8_value_and_midpoint_rounds_like_torch():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[~codes.isnan()].sort().values  # [254]
    mids = (codes[1:] + codes[:-1]) / 2  # ties: round to the even code
    x = torch.cat([codes, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1),
                   torch.tensor([500.0, -1e6, 464.0, 1e-9, -0.0])]).to(DEVICE)
    x = torch.cat([x, x.new_zeros(-x.numel() % 16)]).view(-1, 16)
    one = torch.ones((), device=DEVICE)
    q, _ = scaled_fp8_quant(x, one, per_token=False)
    assert torch.equal(q.view(torch.uint8), quantize_fp8_ref(x, one).view(torch.uint8))
    inside = x.abs() <= FP8_E4M3_MAX  # and, where nothing saturates, PyTorch's own cast
    assert torch.equal(q[inside].view(torch.uint8), x[inside].to(FP8).view(torch.uint8))


def test_activation_quantization_refuses_bad_input():
    x = torch.randn(4, 32, device=DEVICE)
    for fn in (scaled_fp8_quant, scaled_fp8_quant_ref):
        with pytest.raises(TypeError, match="x must be"):
            fn(x.to(torch.int32))
        with pytest.raises(ValueError, match="x must be 2-D"):
            fn(x[None])
        with pytest.raises(ValueError, match="scale must be a one-element float32 tensor"):
            fn(x, torch.ones(2, device=DEVICE), per_token=False)


# ---- the GEMM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel,per_token", [(True, True), (False, False), (True, False), (False, True)])
def test_reference_gemm_is_scaled_mm_math(g, per_channel, per_token):
    if not has_scaled_mm(DEVICE):
        pytest.skip(f"this PyTorch has no torch._scaled_mm on {DEVICE}")
    M, K, N = 37, 128, 80
    w, x = rand(g, N, K), rand(g, M, K) * 3
    q_w, s_w = quantize_weight_fp8(w, per_channel)
    q_x, s_x = scaled_fp8_quant_ref(x, per_token=per_token)
    out_dtype = torch.bfloat16
    got = fp8_gemm(q_x, s_x, q_w, s_w, out_dtype)
    want = fp8_gemm_ref(q_x, s_x, q_w, s_w, out_dtype)
    assert got.dtype == want.dtype == out_dtype and got.shape == (M, N)
    # the same products and scales; only the summation order may differ: within bf16's last bit
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)


def _layers(qc):
    """Each linear layer kind (dims multiples of 16, as cuBLAS's FP8 GEMM wants), with its shards."""
    yield ReplicatedLinear(128, 48, bias=True, quant_config=qc), [(None, 48)]
    yield RowParallelLinear(96, 64, bias=False, quant_config=qc), [(None, 64)]
    yield MergedColumnParallelLinear(64, [48, 32], bias=False, quant_config=qc), [(0, 48), (1, 32)]
    yield QKVParallelLinear(64, 16, 4, 2, bias=True, quant_config=qc), [("q", 64), ("k", 32), ("v", 32)]


@pytest.mark.parametrize("weight_scale", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("activation_scale", ["per_token", "per_tensor"])
@pytest.mark.parametrize("M", [3, 19])  # weight-only, W8A8
def test_each_layer_is_within_20_db_of_full_precision(g, weight_scale, activation_scale, M):
    """torchao's oracle: the quantized layer's output vs the full-precision layer's, SQNR >= 20 dB."""
    qc = Fp8Config(weight_scale, activation_scale, emulate=not FP8_GPU)
    dtype = torch.bfloat16 if FP8_GPU else torch.float32
    for layer, shards in _layers(qc):
        layer = layer.to(DEVICE, dtype)
        K = layer.weight.shape[1]
        parts = [(sid, rand(g, n, K, dtype=dtype) / K**0.5, rand(g, n, dtype=dtype)) for sid, n in shards]
        for sid, w, b in parts:  # through the same weight_loader as an unquantized layer
            layer.weight_loader(layer.weight, w, *([] if sid is None else [sid]))
            if layer.bias is not None:
                layer.weight_loader(layer.bias, b, *([] if sid is None else [sid]))
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
        assert layer.weight_scale.shape == ((layer.weight.shape[0],) if weight_scale == "per_channel" else ())
        w = torch.cat([w for _, w, _ in parts]).float()
        x = rand(g, M, K, dtype=dtype)
        with torch.inference_mode():
            y = layer(x).float() - (torch.cat([b for _, _, b in parts]).float() if layer.bias is not None else 0)
        db = sqnr(x.float() @ w.T, y)
        assert db >= 20, (type(layer).__name__, db)


@pytest.mark.parametrize("M", [5, WEIGHT_ONLY_MAX_M + 1])
def test_the_emulated_layer_is_its_own_dequantized_matmul(g, M):
    """Up to WEIGHT_ONLY_MAX_M rows x as it is (weight-only), above it x quantized per token (W8A8)."""
    layer = ReplicatedLinear(64, 32, bias=False, quant_config=Fp8Config(emulate=True))
    w = torch.randn(32, 64, generator=g)
    layer.weight.weight_loader(layer.weight, w)
    process_weights_after_loading(layer)
    x = torch.randn(M, 64, generator=g)
    q_x, s_x = scaled_fp8_quant_ref(x)
    x_seen = x if M <= WEIGHT_ONLY_MAX_M else q_x.float() * s_x
    want = x_seen @ (layer.weight.float() * layer.weight_scale[:, None]).T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


# ---- through the loader and LLM ---------------------------------------------------------------------

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)


def test_fp8_config_errors():
    assert isinstance(get_quantization_config("fp8"), Fp8Config)
    with pytest.raises(ValueError, match="fp8 weight_scale must be one of per_channel, per_tensor, not 'per_group'"):
        get_quantization_config({"method": "fp8", "weight_scale": "per_group"})
    with pytest.raises(ValueError, match="activation_scale must be one of per_token, per_tensor"):
        get_quantization_config({"method": "fp8", "activation_scale": "dynamic"})
    with pytest.raises(ValueError, match="has no option 'block_size'"):
        get_quantization_config({"method": "fp8", "block_size": 128})


@pytest.mark.parametrize("emulate", [False, True])
def test_an_fp8_model_tracks_the_full_precision_model(seed, emulate):
    """Without FP8 matrix units (a CPU), emulate=False is weight-only at every M: no longer refused."""
    spec = {"method": "fp8", "emulate": emulate}
    dtype = torch.bfloat16 if FP8_GPU else torch.float32
    q_model, _, _ = load_model(TINY, load_format="dummy", quantization=spec, device=DEVICE, dtype=dtype)
    full, _, _ = load_model(TINY, load_format="dummy", device=DEVICE, dtype=dtype)  # the same seeded weights
    from minillm.layers import AttentionMetadata

    ids = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    meta = AttentionMetadata.from_seq_lens([24], DEVICE)
    with torch.inference_mode():
        got = q_model.compute_logits(q_model(ids, torch.arange(24, device=DEVICE), meta))
        want = full.compute_logits(full(ids, torch.arange(24, device=DEVICE), meta))
    assert sqnr(want.float(), got.float()) >= 20


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 matrix units (compute capability >= 8.9)")
@pytest.mark.parametrize("activation_scale", ["per_token", "per_tensor"])
def test_an_fp8_engine_captures_cuda_graphs(seed, activation_scale):
    """The activation quantization and _scaled_mm inside CUDA graphs: graph replay = eager, token for token."""
    from minillm.bench.serving_setup import NoTextTokenizer
    from minillm.engine import EngineConfig, LLMEngine
    from minillm.sampling import SamplingParams

    model, _, _ = load_model(TINY, load_format="dummy", device="cuda", dtype=torch.bfloat16,
                             quantization={"method": "fp8", "activation_scale": activation_scale})
    rng = torch.Generator().manual_seed(seed)
    requests = [(torch.randint(0, TINY.vocab_size, (int(n),), generator=rng).tolist(), SamplingParams(max_tokens=10, temperature=0.0))
                for n in torch.randint(3, 40, (5,), generator=rng)]
    runs = []
    for eager in (True, False):
        engine = LLMEngine(model, NoTextTokenizer(), [], EngineConfig(num_gpu_blocks=64, enforce_eager=eager))
        for i, (p, sp) in enumerate(requests):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        got = {}
        while engine.has_unfinished_requests():
            got |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        runs.append([got[str(i)] for i in range(len(requests))])
    assert runs[0] == runs[1]
