"""The building blocks of a transformer, as PyTorch modules.

Chapter 04 swaps Triton kernels in behind these same interfaces; the PyTorch code stays the
reference those kernels are tested against. The linear layers and the embedding carry vLLM's names
and a quant_method each (linear.py, vocab_parallel_embedding.py, quantization/): the seams where
chapter 08 quantizes weights and chapter 11 splits them across GPUs.
"""

from .activation import SiluAndMul
from .attention import Attention, AttentionMetadata
from .layernorm import RMSNorm
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from .rotary_embedding import RotaryEmbedding, apply_rotary
from .vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = ["Attention", "AttentionMetadata", "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead",
           "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "VocabParallelEmbedding", "apply_rotary"]
