"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one PyTorch model.

    input_ids [T] -> embed_tokens -> 30 x LlamaDecoderLayer -> norm -> (last tokens) -> lm_head -> logits

A decoder layer, for SmolLM2 (hidden 576, 9 query heads, 3 KV heads of 64, FFN 1536):

    x [T, 576] --RMSNorm--> qkv_proj [T, 576+192+192] -> q [T, 9, 64], k [T, 3, 64], v [T, 3, 64]
               --RoPE(q, k)--> attention (each KV head serves 3 query heads) -> [T, 576] --o_proj--> + x
    x [T, 576] --RMSNorm--> gate_up_proj [T, 2*1536] --silu(gate)*up--> [T, 1536] --down_proj--> + x

q, k and v come out of one fused matrix (`qkv_proj`), gate and up out of another (`gate_up_proj`),
as in vLLM: one large GEMM instead of three small ones. The layers (layers/linear.py) own the shapes,
the split across GPUs and the loading; this file says only which layers there are and how a
checkpoint's separate q_proj/k_proj/v_proj and gate_proj/up_proj tensors stack into them
(`stacked_params_mapping`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers import (
    Attention,
    AttentionMetadata,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from ..layers.attention import rotate
from ..layers.decode_gemv import gemv_fits, gemv_linear
from ..layers.layernorm import fuses_into, norm_linear
from ..layers.quantization import QuantizationConfig
from .utils import load_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads,
                                          bias=config.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        # this rank's heads (all of them until chapter 11 splits the heads across GPUs)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: normalise each head's query and key before rotating them
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, config.sliding_windows[layer])

    def forward(self, positions: torch.Tensor, x: torch.Tensor | None, attn_metadata: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden]; or qkv: [T, (Hq + 2 Hkv) * D], the projection already made (norm_linear)
        qkv = self.qkv_proj(x) if qkv is None else qkv
        return self.o_proj(self.attend(positions, qkv, attn_metadata, cos_sin))  # [T, Hq * D] -> [T, hidden]

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, attn_metadata: AttentionMetadata,
               cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention of the projected qkv [T, (Hq + 2 Hkv) * D], before o_proj: -> [T, Hq * D]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # QK-norm (Qwen3) and RoPE with cos/sin of these positions (looked up once per forward): with a KV
        # cache on a GPU, by the attention layer in the launch that writes k and v to the cache (chapter 13).
        rope = (cos_sin, self.q_norm, self.k_norm)
        if not self.attn.fuses_rope(q, attn_metadata, *rope):
            q, k = rotate(q, k, *rope)
            rope = (None, None, None)
        return self.attn(q, k, v, positions, attn_metadata, *rope)  # [T, Hq * D]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 reduce_results: bool = True):  # False: the caller all-reduces (MoE shared experts)
        super().__init__()
        I = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], bias=config.mlp_bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(I, config.hidden_size, bias=config.mlp_bias, reduce_results=reduce_results,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden] -> [T, 2I] -> [T, I] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer, quant_config, f"{prefix}.mlp")
        self.decode_gemv: str | None = None  # chapter 18: "gemv" or "pdl" once enabled (layers/decode_gemv.py)

    # a class default too: layers of the families that build their own __init__ (DeepSeek's) inherit it
    decode_gemv: str | None = None

    def has_gemv_path(self) -> bool:
        """Whether forward_gemv can run this layer: the dense one (not a MoE or latent-attention family's)."""
        return isinstance(self.self_attn, LlamaAttention) and isinstance(self.mlp, LlamaMLP)

    def make_mlp(self, config: ModelConfig, layer: int, quant_config, prefix: str) -> nn.Module:
        """The block after attention; a MoE family (models/mixtral.py) returns its experts here."""
        return LlamaMLP(config, quant_config, prefix)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        # The residual stream is carried separately so each norm can fuse "add, then normalise"; for a
        # few tokens (decode) the norm also joins the next projection's kernel (chapter 13: norm_linear).
        attn = self.self_attn
        if self.decode_gemv is not None and gemv_fits(self, x):
            return self.forward_gemv(positions, x, residual, attn_metadata, cos_sin)
        if isinstance(attn, LlamaAttention) and fuses_into(self.input_layernorm, attn.qkv_proj, x):
            qkv, residual = norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
            x = attn(positions, None, attn_metadata, cos_sin, qkv=qkv)
        else:
            if residual is None:
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x = attn(positions, x, attn_metadata, cos_sin)
        if isinstance(self.mlp, LlamaMLP) and fuses_into(self.post_attention_layernorm, self.mlp.gate_up_proj, x):
            # norm, gate_up projection and SiLU-and-mul in one kernel: [T, hidden] -> [T, I]
            h, residual = norm_linear(x, residual, self.post_attention_layernorm, self.mlp.gate_up_proj,
                                      silu_mul=True)
            return self.mlp.down_proj(h), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_gemv(self, positions, x, residual, attn_metadata, cos_sin):
        """Chapter 18's decode layer: four GEMVs (layers/decode_gemv.py) around RoPE + KV store and
        attention; the residual adds happen in o_proj's and down_proj's epilogues, so the stream h is
        one tensor and the layer hands on (h, None)."""
        attn, mlp = self.self_attn, self.mlp
        h = x if residual is None else (x + residual)  # [T, hidden] (a previous layer off this path)
        qkv = gemv_linear(self, h, attn.qkv_proj, norm=self.input_layernorm)  # [T, (Hq + 2 Hkv) * D]
        a = attn.attend(positions, qkv, attn_metadata, cos_sin)  # [T, Hq * D]
        h = gemv_linear(self, a, attn.o_proj, residual=h)  # [T, hidden]
        g = gemv_linear(self, h, mlp.gate_up_proj, norm=self.post_attention_layernorm, silu_mul=True)  # [T, I]
        return gemv_linear(self, g, mlp.down_proj, residual=h), None  # [T, hidden]


class LlamaModel(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer  # a family that changes only the layer sets its own
    rotary_emb_cls = RotaryEmbedding

    def __init__(self, config: ModelConfig, quant_config: QuantizationConfig | None = None, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.rotary_emb = self.rotary_emb_cls(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, attn_metadata):
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)  # [T, 1, head_dim] each, shared by all layers
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn_metadata, cos_sin)
        # residual None: the stream is x alone (chapter 18's GEMV layers add it in their epilogues)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor -> (our stacked parameter, which shard of it)
    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                              ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    model_cls = LlamaModel

    def __init__(self, config: ModelConfig, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, quant_config, "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config, "lm_head")
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden] (logits only where they are needed)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)  # [N, vocab] on rank 0; None on the others under TP
        return None if logits is None else logits.float()  # fp32 for the sampler

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs in Hugging Face naming into the model; returns what was filled.
        Every parameter must be filled exactly once (a stacked one once per shard): models/utils.py."""
        return load_weights(self, weights, self.stacked_params_mapping)
