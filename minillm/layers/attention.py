"""Attention over a packed batch of sequences, with grouped-query heads, in plain PyTorch.

The engine never pads. Sequences of different lengths are concatenated into one stream of T tokens,
and `cu_seqlens` marks where each begins (vLLM's and FlashAttention's convention):

    lengths [3, 1, 2]  ->  tokens  a a a | b | c c        cu_seqlens [0, 3, 4, 6]

A token may attend to the tokens of its own sequence at the same or earlier positions (causal), and
within `sliding_window` positions if the layer has one. Here that is a [T, T] boolean mask handed to
PyTorch's scaled_dot_product_attention, built once per forward pass (every layer shares it); a
single sequence with no window needs none (`is_causal`), which lets PyTorch pick its FlashAttention
kernel. Those fused kernels want one KV head per query head, so each KV head is repeated for its
group (a copy of K and V). Chapter 04 replaces all of this with a FlashAttention kernel of our own
that never builds the T x T matrix and reads each KV head once for its whole group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """How the T tokens of a forward pass split into sequences."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32: start offset of each sequence, then T
    max_seqlen: int
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
    """softmax(q k^T * scale + mask) v for every sequence of the packed batch; q, k already rotated."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]
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
