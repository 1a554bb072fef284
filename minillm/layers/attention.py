"""Attention over a packed batch of sequences, with grouped-query heads, in plain PyTorch.

The engine never pads. Sequences of different lengths are concatenated into one stream of T tokens,
and `cu_seqlens` marks where each begins (vLLM's and FlashAttention's convention):

    lengths [3, 1, 2]  ->  tokens  a a a | b | c c        cu_seqlens [0, 3, 4, 6]

A token may attend to the tokens of its own sequence at the same or earlier positions (causal), and
within `sliding_window` positions if the layer has one. Here that is a [T, T] boolean mask handed to
PyTorch's scaled_dot_product_attention, built once per forward pass (every layer shares it); a
single sequence with no window needs none (`is_causal`), which lets PyTorch pick its FlashAttention
kernel. Those fused kernels want one KV head per query head, so each KV head is repeated for its
group (a copy of K and V). That is the PyTorch path. On a GPU the layer runs chapter 04's own
kernels instead (`minillm.kernels.flash_attn` and `.flash_decode`), which never build the T x T
matrix and read each KV head once for its whole group; with a KV cache (chapter 03) it reads past
keys and values from the cache through a block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.spec import KVCacheSpec
from ..forward_context import maybe_forward_context
from ..kernels import attn_mass as _mass
from ..kernels import flash_attn, flash_decode
from ..kernels import store_kv as _store
from ..kernels.checks import KV_QUANT_DTYPES
from ..kernels.rope_store_kv import rope_store_kv
from .backend import use_triton
from .layernorm import RMSNorm
from .rotary_embedding import apply_rotary


@dataclass
class AttentionMetadata:
    """How the T tokens of a forward pass split into sequences, and (with a KV cache) where their
    keys and values live. vLLM's names: cu_seqlens is its query_start_loc."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32: start offset of each sequence's new tokens, then T
    max_seqlen: int  # longest run of new tokens (1: a pure decode step)
    # With a KV cache (chapter 03); all None without one, when every sequence is computed whole.
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32: keys per sequence, cached + new
    block_table: torch.Tensor | None = None  # [num_seqs, max_blocks] int32: cache blocks of each sequence
    slot_mapping: torch.Tensor | None = None  # [T] int64: flat cache row each new token's K/V goes to
    _masks: dict = field(default_factory=dict, repr=False)  # sliding window -> [T, T] mask, built once

    def mask(self, positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self._masks:
            self._masks[sliding_window] = packed_attention_mask(positions, self.cu_seqlens, sliding_window)
        return self._masks[sliding_window]

    @classmethod
    def from_seq_lens(cls, seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
        return cls(cu_seqlens=cu.to(device), max_seqlen=max(seq_lens))

    @property
    def uses_cache(self) -> bool:
        return self.slot_mapping is not None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index of each sequence's last token in the packed stream: where its next token is predicted."""
        return (self.cu_seqlens[1:] - 1).long()


def packed_attention_mask(positions: torch.Tensor, cu_seqlens: torch.Tensor,
                          sliding_window: int | None = None) -> torch.Tensor:
    """[T, T] bool: True where query token i may attend to key token j."""
    T = positions.numel()
    seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=positions.device), seq_lens, output_size=T)
    same_seq = seq_id[:, None] == seq_id[None, :]  # [T, T]
    causal = positions[None, :] <= positions[:, None]  # key position <= query position
    mask = same_seq & causal
    if sliding_window is not None:
        mask &= positions[:, None] - positions[None, :] < sliding_window
    return mask


class Attention(nn.Module):
    """softmax(q k^T * scale + mask) v for every sequence of the packed batch.

    q and k arrive rotated, or (given cos_sin, and q_norm/k_norm for Qwen3) raw: the layer then
    normalizes and rotates them itself, which with a KV cache on the Triton path is one kernel that
    also writes the cache (`minillm.kernels.rope_store_kv`, chapter 13) instead of three or four.

    Three paths, one result:
      - with a KV cache (metadata has a slot_mapping): store the new K/V, then attend over the cache:
        FlashDecoding when every sequence brings one token, FlashAttention over the cache otherwise;
      - without one, on the Triton path: FlashAttention over the packed K/V;
      - without one, on the PyTorch path: SDPA with a mask (chapter 02).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the cache (cache/spec.py)
        # A quantized (fp8/int8) cache's scales (vLLM's k_scale/v_scale), fp32: keys one per KV head and
        # channel [Hkv, D] (keys have outlier channels), values one per KV head [Hkv]. Set by calibration
        # (layers/quantization/kv_cache.py), which also records the qmax they are for; buffers, not
        # parameters: no checkpoint has them. Tensors, so CUDA graphs read them live.
        self.register_buffer("k_scale", torch.ones(num_kv_heads, head_dim, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        # What the attention kernels get as their per-head K scale: 1, as k_scale is folded into q.
        self.register_buffer("unit_k_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        self.pdl = False  # chapter 18 (layers/decode_gemv.py): rope_store_kv and flash_decode launched with PDL
        self.kv_scale_qmax: float | None = None  # None: not calibrated (a quantized cache is refused)

    kv_connector_hooks = True  # chapter 17: _cached calls a KV connector's layer hooks (other layers refuse one)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer caches per token: a key and a value per KV head (fp8/int8: with scales)."""
        return KVCacheSpec(self.num_kv_heads, self.head_dim, dtype, has_scales=dtype in KV_QUANT_DTYPES)

    def fuses_rope(self, q: torch.Tensor, attn_metadata: AttentionMetadata, cos_sin, q_norm: RMSNorm | None,
                   k_norm: RMSNorm | None) -> bool:
        """Whether forward should be handed q and k raw, with cos_sin (and the norms), to rotate them in
        the kernel that writes the cache: with a cache, on the Triton path, and with no forward pre-hook
        on this layer (KV calibration and the bf16 control read k from its arguments, rotated)."""
        return (attn_metadata.uses_cache and self.kv_cache is not None and not self._forward_pre_hooks
                and fusable(q, cos_sin, q_norm, k_norm))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]
        # cos_sin: [T, 1, head_dim] each, to rotate q and k here (None: they are rotated already)
        T, m = q.shape[0], attn_metadata
        if m.uses_cache:
            return self._cached(q, k, v, m, cos_sin, q_norm, k_norm).reshape(T, self.num_heads * self.head_dim)
        if cos_sin is not None:
            q, k = rotate(q, k, cos_sin, q_norm, k_norm)
        if use_triton(q):
            out = flash_attn.flash_attn_varlen(q, k, v, m.cu_seqlens, m.max_seqlen, cu_seqlens_k=m.cu_seqlens,
                                               softmax_scale=self.scale, sliding_window=self.sliding_window)
            return out.reshape(T, self.num_heads * self.head_dim)
        return self._sdpa(q, k, v, positions, m)

    def _cached(self, q, k, v, m: AttentionMetadata, cos_sin, q_norm, k_norm) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("attention metadata has a slot_mapping but no KV cache is bound to this layer")
        k_cache, v_cache = self.kv_cache  # [num_blocks, block_size, Hkv, D] each
        ctx = maybe_forward_context()
        connector = ctx.kv_connector if ctx is not None else None  # chapter 17: a KV connector's hooks
        if connector is not None:  # this layer's remote K/V land in its blocks before it attends over them
            connector.wait_for_layer_load(self)
        quantized = k_cache.dtype in KV_QUANT_DTYPES  # fp8/int8: quantized on write, dequantized in the kernels
        if quantized and self.kv_scale_qmax is None:
            raise RuntimeError(f"a {k_cache.dtype} KV cache is bound but this layer's k_scale/v_scale were "
                               "never calibrated (minillm.layers.quantization.kv_cache.calibrate_kv_scales)")
        write_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if quantized else {}
        if cos_sin is not None and fusable(q, cos_sin, q_norm, k_norm):
            # One launch: (QK-norm,) RoPE, the cache write (quantized), the keys' scales folded into q.
            norms = {} if q_norm is None else dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight,
                                                   eps=q_norm.eps)
            q = rope_store_kv(q, k, v, *cos_sin, k_cache, v_cache, m.slot_mapping, fold_k_scale=quantized,
                              **norms, **write_scales, **({"pdl": True} if self.pdl else {}))
        else:
            if cos_sin is not None:
                q, k = rotate(q, k, cos_sin, q_norm, k_norm)
            store_kv(k, v, k_cache, v_cache, m.slot_mapping, **write_scales)
            if quantized:
                q = fold_k_scale(q, self.k_scale)  # the keys' per-channel scales, applied to the query instead
        if connector is not None:  # handed off as soon as they are written: the save overlaps what follows
            connector.save_kv_layer(self, k_cache, v_cache, m)
        scales = dict(k_scale=self.unit_k_scale, v_scale=self.v_scale) if quantized else {}
        triton = use_triton(q)
        if m.max_seqlen == 1:  # decode: one query per sequence over its whole cached past
            decode = flash_decode.flash_decode if triton else flash_decode.flash_decode_ref
            pdl = {"pdl": True} if self.pdl and triton else {}  # chapter 18's decode_backend="pdl"
            out = decode(q, k_cache, v_cache, m.seq_lens, m.block_table, softmax_scale=self.scale,
                         sliding_window=self.sliding_window, **scales, **pdl)  # [B, Hq, D]
        else:
            prefill = flash_attn.flash_attn_varlen if triton else flash_attn.flash_attn_varlen_ref
            out = prefill(q, k_cache, v_cache, m.cu_seqlens, m.max_seqlen, seqused_k=m.seq_lens,
                          block_table=m.block_table, softmax_scale=self.scale,
                          sliding_window=self.sliding_window, **scales)  # [T, Hq, D]
        ctx = maybe_forward_context()
        if ctx is not None and (observed := ctx.extras.get("attn_mass")) is not None:
            # H2O, SnapKV (chapter 15): the probability each cached key got this step, added up over the layers
            mass, window = observed  # mass: [B, keys]; window: None (every query) or (token indices, cu_seqlens)
            qs, cu = (q, m.cu_seqlens) if window is None else (q[window[0]], window[1])
            add_mass = _mass.attention_mass if triton else _mass.attention_mass_ref
            add_mass(mass, qs, k_cache, m.block_table, m.seq_lens, cu, self.scale)
        return out

    def _sdpa(self, q, k, v, positions, attn_metadata) -> torch.Tensor:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, head_dim]
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # PyTorch's fused kernels want one KV head per query head
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [num_heads, T, D]
        if attn_metadata.num_seqs == 1 and (self.sliding_window is None or self.sliding_window >= q.shape[1]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # no mask needed
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_metadata.mask(positions, self.sliding_window),
                                                 scale=self.scale)
        return out.transpose(0, 1).reshape(q.shape[1], self.num_heads * self.head_dim)  # [T, heads * head_dim]


def rotate(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
           q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: Qwen3's per-head norms (if any), then RoPE on q [T, Hq, D] and k [T, Hkv, D]."""
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, k, *cos_sin)


def fusable(q: torch.Tensor, cos_sin, q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool:
    """Whether rope_store_kv can stand in for rotate + store_kv: the Triton path, cos/sin and the
    norms' weights in q's dtype, the two norms alike (one eps)."""
    if not use_triton(q) or any(t.dtype != q.dtype for t in cos_sin):
        return False
    if q_norm is None or k_norm is None:
        return q_norm is None and k_norm is None
    return q_norm.weight.dtype == k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps


def fold_k_scale(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] times the keys' per-channel scales k_scale [Hkv, D], each KV head's scales over
    its group of query heads, in q's dtype. A score is a sum over channels,

        q . (s * k_q) = sum_d q_d s_d k_q,d = (q * s) . k_q,

    so attending with q * s over the stored codes k_q (a unit K scale in the kernels) is attending
    with q over the dequantized keys: one multiply on the T queries instead of one per cached key."""
    Hkv = k_scale.shape[0]
    q_groups = q.unflatten(1, (Hkv, q.shape[1] // Hkv))  # [T, Hkv, group, D], a view: head h = kv * group + g
    out = torch.empty(q_groups.shape, dtype=q.dtype, device=q.device)
    torch.mul(q_groups, k_scale[:, None, :], out=out)  # one launch: multiplied in fp32, rounded once to q's dtype
    return out.flatten(1, 2)  # [T, Hq, D]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the new tokens' K and V into their cache rows (vLLM: reshape_and_cache).

    k, v: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] flat row of each token (block * block_size + offset), int64 or int32. A slot < 0
    (vLLM's PAD_SLOT_ID = -1, a padding token of a CUDA-graph batch) writes nothing.

    On a GPU this is one Triton launch (`minillm.kernels.store_kv`, CUDA-graph capturable); elsewhere,
    or with MINILLM_KERNELS=torch, its PyTorch reference: index_copy_ into the caches viewed flat.
    An fp8/int8 cache (chapter 08) is quantized on the way in with k_scale (fp32 [Hkv] or [Hkv, D])
    and v_scale (fp32 [Hkv]).
    """
    (_store.store_kv if use_triton(k) else _store.store_kv_ref)(k, v, k_cache, v_cache, slot_mapping,
                                                                 k_scale, v_scale)
