"""Multi-head latent attention (layers/mla.py, kernels/mla_decode.py): the absorbed path equals the
naive one on random weights, the paged kernel equals its reference through a shuffled block table
with NaN in every slot it must not read, YaRN equals transformers' numbers, the cache holds one
latent per token (the bytes formula), and inconsistent MLA dimensions are clear errors.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_kernels_moe import DEVICE, DTYPES, INTERPRETED, TOL, rel

from minillm.cache import bytes_per_token, kv_cache_spec
from minillm.config import MLAConfig, ModelConfig, MoEConfig, preset
from minillm.kernels.mla_decode import mla_decode, mla_decode_ref, store_latent, store_latent_ref
from minillm.layers import AttentionMetadata
from minillm.layers.backend import kernel_mode
from minillm.layers.mla import DeepseekRotaryEmbedding, MultiHeadLatentAttention, mla_softmax_scale


def paged_latents(g, lens: list[int], width: int, block_size: int, dtype):
    """A cache with each sequence's latents in shuffled blocks, every other slot NaN, and the
    block table (unused entries point at a NaN block)."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.full((num_blocks, block_size, 1, width), float("nan"))
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays NaN: the table's filler
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    at = 0
    for b, (n, k) in enumerate(zip(lens, need)):
        table[b, :k] = perm[at:at + k].to(torch.int32)
        at += k
        pos = torch.arange(n)
        cache[table[b, pos // block_size].long(), pos % block_size, 0] = torch.randn(n, width, generator=g)
    return cache.to(DEVICE, dtype), table.to(DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4))
def test_mla_kernel_matches_reference_through_a_shuffled_block_table(seed, case):
    rng, g = random.Random(seed * 10 + case), torch.Generator().manual_seed(seed * 10 + case)
    L, R, H = (32, 16, rng.choice([4, 20])) if INTERPRETED else (512, 64, rng.choice([16, 128]))
    block_size = rng.choice([4, 16])
    B = rng.randint(1, 4)
    lens = [rng.randint(1, 70 if INTERPRETED else 5000) for _ in range(B)]
    # case 0-1: a decode step (one row per sequence); 2-3: prefill chunks (several rows, causal)
    rows = [(b, n) for b, n in enumerate(lens)] if case < 2 else \
        [(b, k) for b, n in enumerate(lens) for k in range(max(1, n - rng.randint(0, 5)), n + 1)]
    seq_idx = torch.tensor([b for b, _ in rows], dtype=torch.int32, device=DEVICE)
    kv_lens = torch.tensor([k for _, k in rows], dtype=torch.int32, device=DEVICE)
    for dtype in DTYPES:
        cache, table = paged_latents(g, lens, L + R, block_size, dtype)
        q = torch.randn(len(rows), H, L + R, generator=g).to(DEVICE, dtype)
        want = mla_decode_ref(q, cache, kv_lens, seq_idx, table, L, 0.1)
        assert not want.isnan().any()
        for splits in (None, 1, 3):
            got = mla_decode(q, cache, kv_lens, seq_idx, table, L, 0.1, num_splits=splits)
            assert not got.isnan().any(), (dtype, splits)
            assert rel(got, want) < TOL[dtype], (dtype, splits, rel(got, want))


def test_mla_reference_is_softmax_attention_over_the_latents(seed):
    """The reference itself, against attention written out for one sequence stored contiguously."""
    g = torch.Generator().manual_seed(seed)
    n, H, L, R = 9, 3, 8, 4
    lat = torch.randn(n, L + R, generator=g)
    q = torch.randn(1, H, L + R, generator=g)
    cache = lat.view(1, n, 1, L + R)
    got = mla_decode_ref(q, cache, torch.tensor([n]), torch.tensor([0]), torch.tensor([[0]]), L, 0.3)
    want = torch.softmax(q[0] @ lat.t() * 0.3, dim=-1) @ lat[:, :L]
    torch.testing.assert_close(got[0], want)


def test_store_latent_writes_its_rows_and_skips_padding(seed):
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(3, 4, 1, 48, device=DEVICE)
    x = torch.randn(4, 48, generator=g).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 11], device=DEVICE)
    for store in (store_latent, store_latent_ref):
        cache.zero_()
        store(x, cache, slots)
        flat = cache.view(-1, 48)
        assert torch.equal(flat[[5, 0, 11]], x[[0, 2, 3]])
        assert flat.abs().sum(-1).count_nonzero() == 3


def test_mla_kernel_bad_arguments_are_clear_errors():
    q = torch.randn(2, 4, 48, device=DEVICE)
    cache = torch.randn(3, 4, 1, 48, device=DEVICE)
    lens, idx = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE), torch.tensor([0, 0], dtype=torch.int32,
                                                                                       device=DEVICE)
    table = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be \\[blocks, block_size, 1, 48\\]"):
        mla_decode(q, cache[..., :40], lens, idx, table, 32, 0.1)
    with pytest.raises(ValueError, match="power of two >= 16"):
        mla_decode(q, cache, lens, idx, table, 24, 0.1)
    with pytest.raises(ValueError, match="kv_lora_rank must be in 1..47"):
        mla_decode_ref(q, cache, lens, idx, table, 48, 0.1)
    with pytest.raises(TypeError, match="kv_lens must be int32"):
        mla_decode(q, cache, lens.long(), idx, table, 32, 0.1)


# ---- the layer: absorbed (through the cache) = naive (no cache) ----------------------------------


def mla_config(q_lora_rank=None, yarn=False, **mla) -> ModelConfig:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
               "mscale_all_dim": 0.8} if yarn else None
    fields = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=q_lora_rank)
    return ModelConfig(architecture="deepseek_v2", vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=1,
                       num_heads=5, num_kv_heads=5, head_dim=8, max_position_embeddings=256, rope_scaling=scaling,
                       mla=MLAConfig(**(fields | mla)))


def run_cached(layer, rope, x, chunks: list[int], block_size: int, g) -> torch.Tensor:
    """x [n, hidden] of one sequence, fed in chunks (a prefill, more prefill, decodes) through a paged
    latent cache in shuffled blocks, unused rows NaN; the outputs of all chunks, concatenated."""
    n, width, dev = x.shape[0], layer.L + layer.R, x.device
    blocks = -(-n // block_size)
    cache = torch.full((blocks + 2, block_size, 1, width), float("nan"), dtype=x.dtype, device=dev)
    table = (torch.randperm(blocks + 1, generator=g)[:blocks] + 1).to(dev, torch.int32)[None]  # block 0 unused
    layer.attn.kv_cache = (cache, None)
    outs, done = [], 0
    for c in chunks:
        pos = torch.arange(done, done + c, device=dev)
        meta = AttentionMetadata.from_seq_lens([c], dev)
        meta.seq_lens = torch.tensor([done + c], dtype=torch.int32, device=dev)
        meta.block_table = table
        meta.slot_mapping = (table[0, pos // block_size].long() * block_size + pos % block_size)
        outs.append(layer(pos, x[done:done + c], meta, rope.cos_sin(pos, x.dtype)))
        done += c
    layer.attn.kv_cache = None
    return torch.cat(outs)


def check_absorbed_equals_naive(seed: int, config: ModelConfig, block_sizes: list[int], kernels: bool) -> None:
    """The naive path (no cache: up-projected K/V, PyTorch's SDPA) on both kernel modes, and the
    absorbed one (chunks through a paged latent cache) through the references, then (kernels=True)
    through the Triton kernels: all equal on random weights, in fp32."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layer = MultiHeadLatentAttention(config)
    for name, p in layer.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else torch.randn(p.shape, generator=g)
                * p.shape[-1] ** -0.5)
    layer.to(DEVICE)  # fp32 on a GPU too: the Triton kernels then take IEEE dots
    rope = DeepseekRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling)
    rope.compute_cache(DEVICE)
    n = rng.randint(20, 40)
    x = torch.randn(n, config.hidden_size, generator=g).to(DEVICE)
    pos = torch.arange(n, device=DEVICE)
    first = rng.randint(1, n - 6)
    chunks = [first, n - first - 4, 1, 1, 1, 1]  # prefill, a second chunk over cached keys, four decodes
    with kernel_mode("torch"):  # the naive path and the absorbed one through the references
        naive = layer(pos, x, AttentionMetadata.from_seq_lens([n], DEVICE), rope.cos_sin(pos, x.dtype))
        assert rel(run_cached(layer, rope, x, chunks, rng.choice(block_sizes), g), naive) < 1e-5
    with kernel_mode("triton"):  # the Triton kernels (the interpreter on a CPU)
        # the naive path's heads are P + R wide (DeepSeek's 192: no power of two, which chapter 04's
        # attention kernels need): it stays on SDPA with the kernels on, around Triton's RMSNorm/RoPE
        again = layer(pos, x, AttentionMetadata.from_seq_lens([n], DEVICE), rope.cos_sin(pos, x.dtype))
        assert rel(again, naive) < 1e-5
        if kernels:
            assert rel(run_cached(layer, rope, x, chunks, rng.choice(block_sizes), g), naive) < 1e-5


@pytest.mark.parametrize("q_lora_rank,yarn,interleave", [(None, False, True), (12, True, True), (12, False, False)])
@torch.inference_mode()
def test_absorbed_equals_naive(seed, q_lora_rank, yarn, interleave):
    # qk heads 16 + 8 = 24 wide: not a power of two, as DeepSeek's 128 + 64 are not
    check_absorbed_equals_naive(seed, mla_config(q_lora_rank, yarn, rope_interleave=interleave), [1, 4, 16], True)


@pytest.mark.parametrize("q_lora_rank", [None, 64])
@torch.inference_mode()
def test_absorbed_equals_naive_at_deepseek_head_dims(seed, q_lora_rank):
    """DeepSeek-V2/V3's head dims (latent 512, qk 128 + 64 = 192, v 128), few heads, a small hidden
    size, YaRN: both paths on their kernels where a GPU runs them (the interpreter would take minutes
    over 576-wide latents: on a CPU the paged kernel is the other test's, at small dims)."""
    config = mla_config(q_lora_rank, yarn=True, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128).with_(head_dim=64, num_heads=4, num_kv_heads=4)
    check_absorbed_equals_naive(seed, config, [16, 64], kernels=not INTERPRETED)


def test_yarn_matches_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf_cfg = transformers.DeepseekV2Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64,
                                           max_position_embeddings=8192,
                                           rope_parameters=scaling | {"rope_theta": 10000.0})
    inv_freq, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = DeepseekRotaryEmbedding(64, 8192, 10000.0, scaling)
    pos = torch.tensor([0, 1, 777, 8191])
    freqs = pos[:, None].float() * inv_freq[None, :]
    # angles up to 8191 rad in fp32: the two blends of the same frequencies differ by an ulp or so
    torch.testing.assert_close(ours.cos_cache[pos], torch.cat((freqs, freqs), -1).cos() * attn_factor, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.sin_cache[pos], torch.cat((freqs, freqs), -1).sin() * attn_factor, atol=1e-4, rtol=0)
    mid = DeepseekRotaryEmbedding(64, 8192, 10000.0, scaling | {"mscale": 1.0})  # an attention factor != 1
    _, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.DeepseekV2Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, max_position_embeddings=8192,
        rope_parameters=scaling | {"rope_theta": 10000.0, "mscale": 1.0}), "cpu")
    assert factor != 1.0 and mid.cos_cache[0, 0].item() == pytest.approx(factor)
    lite = preset("deepseek-v2-lite")  # DeepSeek's softmax scale: 1/sqrt(192) * mscale(40, 0.707)^2
    assert mla_softmax_scale(lite) == pytest.approx(192**-0.5 * (0.1 * 0.707 * torch.tensor(40.0).log().item() + 1) ** 2)


# ---- the cache: one latent per token and layer -----------------------------------------------------


def test_latent_cache_bytes_per_token_follow_the_formula():
    lite = preset("deepseek-v2-lite")
    specs = kv_cache_spec(lite, torch.bfloat16)
    assert len(specs) == 27 and all(s.num_kv_heads == 1 and s.head_size == 576 and not s.has_v for s in specs)
    assert bytes_per_token(specs) == 27 * (512 + 64) * 2
    # DeepSeek-V3's attention: per layer 1,152 B of latent against 128 heads x (192 + 128) x 2 B naive K/V
    v3 = lite.with_(num_heads=128, num_kv_heads=128, num_layers=2, sliding_windows=[], hidden_size=256, moe=None,
                    mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  q_lora_rank=64))
    latent = bytes_per_token(kv_cache_spec(v3, torch.bfloat16)) // 2
    assert latent == 1152 and (128 * (192 + 128) * 2) / latent == pytest.approx(71.1, abs=0.05)


def test_inconsistent_mla_dims_are_clear_errors():
    with pytest.raises(ValueError, match="mla.qk_rope_head_dim must be even"):
        MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=16)
    with pytest.raises(ValueError, match="mla.kv_lora_rank must be a positive int"):
        MLAConfig(kv_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(ValueError, match="mla.q_lora_rank must be None or a positive int"):
        MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=-1)
    with pytest.raises(ValueError, match=r"config.head_dim \(12\) must equal mla.qk_rope_head_dim \(8\)"):
        kv_cache_spec(mla_config().with_(head_dim=12))
    with pytest.raises(ValueError, match="needs an MLA config"):
        kv_cache_spec(mla_config().with_(mla=None))
    with pytest.raises(ValueError, match="'yarn' is supported for latent-attention"):
        mla_config(yarn=True).with_(architecture="llama", mla=None)
    hf = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 48, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 97, "kv_lora_rank": 32,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 20}
    with pytest.raises(ValueError, match=r"qk_head_dim \(20\) must be qk_nope_head_dim \+ qk_rope_head_dim"):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(hf | {"qk_head_dim": 24}).mla.kv_lora_rank == 32
    with pytest.raises(ValueError, match="moe.scoring_func must be one of softmax, sigmoid"):
        MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, scoring_func="relu")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_mla_kernel_replays_in_a_cuda_graph_with_new_lengths(seed):
    """Captured once, replayed after the sequences grew and the queries changed: the key counts are
    read on the device, so the graph's result follows them."""
    g = torch.Generator().manual_seed(seed)
    lens = [4000, 4100, 5000, 4500]
    cache, table = paged_latents(g, lens, 576, 16, torch.bfloat16)
    q = torch.randn(4, 128, 576, generator=g).to(DEVICE, torch.bfloat16)
    kv_lens = torch.tensor([n - 100 for n in lens], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.arange(4, dtype=torch.int32, device=DEVICE)
    mla_decode(q, cache, kv_lens, seq_idx, table, 512, 0.05)  # compile and autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q, cache, kv_lens, seq_idx, table, 512, 0.05)
    for grow in (37, 100):
        kv_lens.copy_(torch.tensor([n - 100 + grow for n in lens], dtype=torch.int32))
        q.copy_(torch.randn(4, 128, 576, generator=g).to(DEVICE, torch.bfloat16))
        graph.replay()
        assert not out.isnan().any()
        assert rel(out, mla_decode_ref(q, cache, kv_lens, seq_idx, table, 512, 0.05)) < TOL[torch.bfloat16]
