"""The token embedding and the LM head, split by vocabulary rows across tensor-parallel ranks.

    VocabParallelEmbedding  rank r holds rows [r * V/tp, (r + 1) * V/tp) of the [V, hidden] table; a
                            token outside its range looks up zeros, and the all-reduce sums the ranks'
                            rows into the one real embedding
    ParallelLMHead          the same split: each rank computes the logits of its own vocabulary slice,
                            gathered into [N, V] on rank 0 only, the rank that samples (the table may
                            be the embedding's own, when tied)

With one rank both are a plain table: F.embedding and F.linear.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from .linear import copy_checked
from .quantization.base import QuantizationConfig, UnquantizedEmbeddingMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.prefix = num_embeddings, embedding_dim, prefix
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        # the last rank's slice may be shorter: ceil(V / tp) rows each, the overhang never looked up
        per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.num_embeddings_per_partition = per_rank
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, per_rank, embedding_dim, torch.get_default_dtype(), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if self.tp_size > 1:  # this rank's rows; the overhang of the last rank is zeros (never looked up, and
            # its logits are cut off, but a quantizer that scales the whole table must not see garbage)
            loaded_weight = loaded_weight[self.vocab_start : self.vocab_end]
            param.data[loaded_weight.shape[0]:].zero_()
            return copy_checked(param.data[: loaded_weight.shape[0]], loaded_weight)
        copy_checked(param.data, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)  # [T] -> [T, hidden]
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        x = self.quant_method.embedding(self, torch.where(mine, input_ids - self.vocab_start, 0))
        return tensor_model_parallel_all_reduce(x * mine.unsqueeze(-1))  # [T, hidden]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, hidden] -> logits [N, vocab] on rank 0 (each rank's slice, gathered there); None on
    the other ranks, which only sample through rank 0 (nano-vllm and vLLM gather the same way)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__(num_embeddings, embedding_dim, quant_config, prefix)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's table (tie_word_embeddings): the same tensors (a packed table's too) and
        the method that reads them, so one copy serves the lookup and the logits."""
        for name in list(self._parameters):
            delattr(self, name)
        for name, p in embed_tokens.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.quant_method = embed_tokens.quant_method
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.quant_method.apply(self, hidden)  # [N, ceil(V / tp)]
        logits = tensor_model_parallel_gather(logits, dst=0)  # [N, V (+ overhang)] on rank 0, else None
        return None if logits is None else logits[..., : self.num_embeddings]

    def forward(self, *args):
        raise RuntimeError("the LM head is applied through compute_logits(hidden), not called")
