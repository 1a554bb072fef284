"""Multi-head latent attention (MLA; DeepSeek-V2, 2024): K and V of every head from one cached latent.

Per token, MLA computes a small latent c = RMSNorm(x W_DKV) (kv_lora_rank = L numbers, 512 in V2/V3)
and one shared rotary key part k_pe (R = 64), and caches only [c, k_pe]. Head h's key and value are
up-projections of c:

    k_h = [c W_UK_h, k_pe]   (P + R = 128 + 64)      v_h = c W_UV_h   (V = 128)      (W_UK, W_UV: kv_b_proj)
    q_h = [q_nope_h, q_pe_h] (from x, through an optional low-rank q_a_proj -> q_b_proj)

so the cache holds L + R = 576 numbers per token and layer instead of 2 x 128 heads x 192: 71 times
fewer for DeepSeek-V3. Two ways to compute the same attention (vLLM keeps both):

* naive (`_naive`, the oracle): up-project c to every head's K and V, then ordinary attention.
  Compute-friendly: prefill's cost is in the T x T scores anyway, and the heads are only 192 wide.
* absorbed (`_absorbed`): q_nope_h . (c W_UK_h) = (q_nope_h W_UK_h^T) . c, so fold W_UK into the
  query once per token, attend over the latents directly as one KV head of width L + R shared by
  all heads (its first L numbers are also the value), and apply W_UV to the [H, L] result:

      q_lat_h = q_nope_h W_UK_h          o_h = softmax(q_h' . [c, k_pe]) c      out_h = o_h W_UV_h^T

  Data-movement-friendly: a decode step reads each cached latent once for all heads, and nothing is
  ever expanded to per-head K/V. minillm runs it whenever there is a KV cache: decode and prefill
  chunks both go through kernels/mla_decode.py (one query row per program, each with its own number
  of visible keys), which also makes a prefix hit or a chunked prefill plain.

RoPE on the R rotary dims: DeepSeek pairs coordinates (2i, 2i+1); we de-interleave q_pe and k_pe
(the same permutation for both leaves every q.k unchanged) and rotate them the Llama way. With YaRN
scaling (V2/V3's 160k context) the frequencies are stretched, cos/sin carry an attention factor, and
the softmax scale grows by mscale(factor, mscale_all_dim)^2 (Peng et al., 2023; DeepSeek's configs).

Tensor parallelism (chapter 11) splits the heads: every rank computes the same latent and caches it
whole, runs its H / tp heads through either path with its slices of q_b_proj and kv_b_proj (W_UK,
W_UV), and o_proj's all-reduce sums the ranks' heads. The latent cache is therefore replicated: it
costs every rank L + R numbers per token, and TP does not shrink it as it shrinks a Llama cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.spec import KVCacheSpec
from ..config import ModelConfig
from ..distributed import divide, get_tensor_model_parallel_world_size
from ..kernels import mla_decode as _kernel
from .attention import AttentionMetadata
from .backend import use_triton
from .layernorm import RMSNorm
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .rotary_embedding import RotaryEmbedding, apply_rotary, inverse_frequencies


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's rule)."""
    mla, scaling = config.mla, config.rope_scaling or {}
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class DeepseekRotaryEmbedding(RotaryEmbedding):
    """RoPE over the R rotary dims, with YaRN frequency scaling and its attention factor on cos/sin."""

    def compute_cache(self, device: torch.device | str | None = None) -> None:
        s = self.scaling or {}
        if s.get("rope_type") != "yarn":
            return super().compute_cache(device)
        dim, base, factor = self.head_dim, self.base, s["factor"]
        old_ctx = s["original_max_position_embeddings"]
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations):  # the dim whose wavelength fits `rotations` turns in old_ctx
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inverse_frequencies(dim, base)  # [dim/2]
        # high frequencies (ramp 0) kept, low ones (ramp 1) interpolated by the factor, a blend between
        inv_freq = (inv_freq / factor * ramp + inv_freq * (1 - ramp)).to(device)
        attn_factor = s.get("attention_factor")
        if attn_factor is None:
            mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
            attn_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim) if mscale and all_dim
                           else yarn_get_mscale(factor))
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, dim]
        self.register_buffer("cos_cache", emb.cos() * attn_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attn_factor, persistent=False)


class MLAAttention(nn.Module):
    """The cache-holding part: one latent row [c, k_pe] per token, read by every head (cache/spec.py)."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.scale = num_heads, kv_lora_rank, rope_dim, scale
        self.kv_cache: tuple[torch.Tensor, None] | None = None

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        # per rank: the latent belongs to no head, so under tensor parallelism each rank caches all of
        # it (L + R per token, whatever the tp size), not 1 / tp of it as a Llama layer's KV heads
        return KVCacheSpec(1, self.kv_lora_rank + self.rope_dim, dtype, has_v=False)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, m: AttentionMetadata) -> torch.Tensor:
        """q [T, H, L + R] (W_UK folded in), latent [T, L + R] -> [T, H, L]: store, then attend."""
        if self.kv_cache is None:
            raise RuntimeError("attention metadata has a slot_mapping but no KV cache is bound to this layer")
        cache = self.kv_cache[0]  # [blocks, block_size, 1, L + R]
        triton = use_triton(q)
        (_kernel.store_latent if triton else _kernel.store_latent_ref)(latent, cache, m.slot_mapping)
        seq_idx, kv_lens = rows_of_tokens(m, q.shape[0], cache.shape[1])
        attend = _kernel.mla_decode if triton else _kernel.mla_decode_ref
        return attend(q, cache, kv_lens, seq_idx, m.block_table, self.kv_lora_rank, self.scale)


def rows_of_tokens(m: AttentionMetadata, T: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the T tokens: its sequence, and how many keys it sees (itself and all before it),
    int32 [T] each, computed on the device. Padding tokens of a CUDA-graph step get a valid row and
    at least one key (their output is never read)."""
    B = m.num_seqs
    tok = torch.arange(T, device=m.cu_seqlens.device, dtype=m.cu_seqlens.dtype)
    if m.max_seqlen == 1 and T == B:  # decode: token b is sequence b's newest, it sees all its keys
        seq_idx, kv_lens = tok, m.seq_lens
    else:  # tokens after this one in its sequence are not visible to it
        seq_idx = torch.searchsorted(m.cu_seqlens[1:].contiguous(), tok, right=True).clamp_(max=B - 1)
        kv_lens = m.seq_lens[seq_idx] - (m.cu_seqlens[seq_idx + 1] - 1 - tok)
    max_keys = m.block_table.shape[1] * block_size
    return seq_idx.to(torch.int32), kv_lens.clamp(1, max_keys).to(torch.int32)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: DeepSeek's RoPE pairs as Llama's."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 attention: x [T, hidden] -> [T, hidden], absorbed with a cache, naive without."""

    def __init__(self, config: ModelConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        # tensor parallelism (chapter 11) splits the heads, as vLLM does: each rank runs H / tp of them.
        # The latent [c, k_pe] belongs to no head, so every rank computes it (replicated q_a/kv_a and
        # their norms) and caches all of it; the per-head up-projections are column-parallel, o_proj
        # row-parallel (the layer's one all-reduce). The checkpoints stack q_b_proj / kv_b_proj rows head
        # by head ([q_nope | q_pe] and [k_nope | v] blocks), so a rank's contiguous rows are whole heads
        # once the heads divide, which is checked first (the features alone could split mid-head).
        mla, total = config.mla, config.num_heads
        tp, name = get_tensor_model_parallel_world_size(), prefix or "MultiHeadLatentAttention"
        self.num_heads = H = divide(total, tp, f"the {total} query heads of {name} (latent attention)")
        self.L, self.R = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.P, self.V, self.interleave = mla.qk_nope_head_dim, mla.v_head_dim, mla.rope_interleave
        qk = self.P + self.R
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, total * qk, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        else:  # V2 (236B) and V3: q through a low-rank bottleneck too
            self.q_a_proj = ReplicatedLinear(config.hidden_size, mla.q_lora_rank, bias=config.qkv_bias,
                                             quant_config=quant_config, prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, total * qk, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, self.L + self.R, bias=config.qkv_bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.L, config.rms_norm_eps)
        # full precision: the absorbed path reads its weight as W_UK and W_UV (this rank's heads' slices)
        self.kv_b_proj = ColumnParallelLinear(self.L, total * (self.P + self.V), prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(total * self.V, config.hidden_size, bias=config.o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.scale = mla_softmax_scale(config)
        self.attn = MLAAttention(H, self.L, self.R, self.scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_metadata: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads  # H: this rank's heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, self.P + self.R).split([self.P, self.R], dim=-1)  # [T, H, P], [T, H, R]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.L, self.R], dim=-1)  # [T, L], [T, R]
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()[:, None, :]  # [T, 1, R]: one rotary key for all heads
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, k_pe, *cos_sin)
        if attn_metadata.uses_cache:
            out = self._absorbed(q_nope, q_pe, c, k_pe[:, 0], attn_metadata)
        else:
            out = self._naive(q_nope, q_pe, c, k_pe, positions, attn_metadata)
        return self.o_proj(out.reshape(T, H * self.V))  # [T, H, V] -> [T, hidden], summed over the ranks

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.P + self.V, self.L)  # [H, P + V, L]
        return w[:, : self.P], w[:, self.P:]  # W_UK [H, P, L], W_UV [H, V, L]

    def _absorbed(self, q_nope, q_pe, c, k_pe, m: AttentionMetadata) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("thp,hpl->thl", q_nope, w_uk)  # [T, H, L]: W_UK folded into the query
        q = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, L + R]
        o = self.attn(q, torch.cat((c, k_pe), dim=-1), m)  # [T, H, L]: attention over the latents
        return torch.einsum("thl,hvl->thv", o, w_uv)  # [T, H, V]

    def _naive(self, q_nope, q_pe, c, k_pe, positions, m: AttentionMetadata) -> torch.Tensor:
        T, H = c.shape[0], self.num_heads
        k_nope, v = self.kv_b_proj(c).view(T, H, self.P + self.V).split([self.P, self.V], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, P + R]
        k = torch.cat((k_nope, k_pe.expand(T, H, self.R)), dim=-1).transpose(0, 1)  # [H, T, P + R]
        v = v.transpose(0, 1)  # [H, T, V]
        if m.num_seqs == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.mask(positions, None), scale=self.scale)
        return out.transpose(0, 1)  # [T, H, V]
