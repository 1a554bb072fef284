"""The building blocks of a Llama-family transformer, as plain PyTorch modules.

Chapter 04 swaps Triton kernels in behind these same interfaces; the modules here stay the
references those kernels are tested against.
"""

from .activation import SiluAndMul
from .attention import Attention, AttentionMetadata
from .layernorm import RMSNorm
from .rotary_embedding import RotaryEmbedding, apply_rotary

__all__ = ["Attention", "AttentionMetadata", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "apply_rotary"]
