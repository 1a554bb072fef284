"""The vocabulary table in int8 (W8A16): the LM head's logits, and the lookups of an embedding tied to it.

    LLM(quantization="int4")                                  # linear layers int4, the LM head int8 (default)
    LLM(quantization={"method": "int4", "lm_head": "none"})   # the LM head kept in the model's dtype

A decode step reads the LM head's whole [vocab, hidden] table to compute one row of logits: on
Llama-3-8B (128,256 x 4,096) 1.05 GB of bf16, 22 % of what an int4 step reads. Stored as the int8
method stores a weight (int8.py), one int8 per weight and one scale per vocabulary row,

    s_v = max_k |W[v, k]| / 127,      q[v, k] = round(W[v, k] / s_v) in -127..127,      W ~ q * s_v

it is half that (plus 2 bytes a row), and the logits come from the same W8A16 kernel. A row is one
token's output direction: its own scale keeps a rare token's small row from sharing a frequent
token's large steps, and each logit's error stays within half a step per weight (tests bound it).

The embedding looks rows of the table up. When the model ties it to the LM head (SmolLM2), the one
int8 table serves both: a lookup dequantizes only the rows it reads, q[ids] * s[ids], in the model's
dtype. An untied input embedding (Llama-3) stays in the model's dtype: a step reads one of its rows
per token, so int8 would save memory but no step time, and its lookups stay exact.

Loading is the weight-only methods' (weight_only.py): the table arrives in full precision through its
layer's weight_loader and is quantized in process_weights_after_loading. A tensor-parallel rank holds
whole rows (a vocabulary slice), so each row's scale is its own: no reduction across ranks.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.w4a16 import w8a16_gemm, w8a16_gemm_ref
from ..backend import use_triton
from .base import QuantizeMethodBase, UnquantizedEmbeddingMethod
from .utils import matmul_rows, quantize_int8

LM_HEAD_FORMATS = ("int8", "none")  # the weight-only configs' `lm_head` option: int8, or the model's dtype


def is_vocab_table(layer: nn.Module) -> bool:
    """The embedding or the LM head (layers/vocab_parallel_embedding.py), known by the attribute both set
    before asking for their method. Not isinstance, which would import that module here: it imports
    this package (base.py) at its top, and the weight-only methods keep the arrow one way (only gguf.py,
    imported by name when asked for, imports it back)."""
    return hasattr(layer, "num_embeddings_per_partition")


def is_lm_head(layer: nn.Module) -> bool:
    return hasattr(layer, "compute_logits")  # ParallelLMHead's; the embedding has none


class Int8EmbeddingMethod(QuantizeMethodBase):
    """While loading: weight [vocab, hidden] in the model's dtype (the unquantized method's). After: the
    LM head (and an embedding tied to it) holds qweight int8 [vocab, hidden] and scales [vocab] in the
    model's dtype; logits = x (q * s)^T."""

    def __init__(self):
        self.owner = None  # the layer this method was made for (a tied LM head shares it with it)

    def create_weights(self, layer, num_embeddings_per_partition, embedding_dim, params_dtype, weight_loader):
        UnquantizedEmbeddingMethod().create_weights(layer, num_embeddings_per_partition, embedding_dim,
                                                    params_dtype, weight_loader)  # layer.weight [vocab, hidden]
        # weak: the layer holds this method, and a strong reference back would be a cycle that only the
        # garbage collector frees (a deleted model's GPU memory would stay until it runs)
        self.owner = weakref.ref(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters or not is_lm_head(layer):
            return  # already int8 (a tied embedding, done with its LM head), or an input table kept as is
        table = layer.weight  # [vocab, hidden], this rank's rows
        with torch.no_grad():
            q, scales = quantize_int8(table.data)  # int8 [vocab, hidden], [vocab] in the table's dtype
        # tie_weights gave the LM head the embedding's method and its very `weight`: the embedding then
        # takes the same int8 tensors, so one copy serves the lookup and the logits
        owner = self.owner() if self.owner is not None else None
        tied = [owner] if owner is not None and owner is not layer and owner._parameters.get("weight") is table else []
        for module in [layer, *tied]:
            del module.weight  # the full-precision table goes once no layer holds it
        for name, t in (("qweight", q), ("scales", scales)):
            p = nn.Parameter(t, requires_grad=False)
            for module in [layer, *tied]:
                module.register_parameter(name, p)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if "weight" in layer._parameters:  # an untied input table, kept in the model's dtype
            return F.embedding(ids, layer.weight)  # [T] -> [T, hidden]
        # only the rows asked for, dequantized in fp32 and rounded once, as dequantize_int8 rounds the table
        q, s = layer.qweight[ids], layer.scales[ids]  # [T, hidden] int8, [T]
        return (q.float() * s.float()[..., None]).to(s.dtype)  # [T, hidden] in the model's dtype

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden x [N, hidden] -> logits [N, vocab / tp] through the W8A16 GEMM (int8.py's product)."""
        def logits(x2):  # [N, hidden] -> [N, vocab]: the kernel on a GPU, its reference elsewhere
            return (w8a16_gemm if use_triton(x2) else w8a16_gemm_ref)(x2, layer.qweight, layer.scales)

        return matmul_rows(x, bias, logits)
