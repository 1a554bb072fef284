"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one PyTorch model.

    input_ids [T] -> embed_tokens -> 30 x LlamaDecoderLayer -> norm -> (last tokens) -> lm_head -> logits

A decoder layer, for SmolLM2 (hidden 576, 9 query heads, 3 KV heads of 64, FFN 1536):

    x [T, 576] --RMSNorm--> qkv_proj [T, 576+192+192] -> q [T, 9, 64], k [T, 3, 64], v [T, 3, 64]
               --RoPE(q, k)--> attention (each KV head serves 3 query heads) -> [T, 576] --o_proj--> + x
    x [T, 576] --RMSNorm--> gate_up_proj [T, 2*1536] --silu(gate)*up--> [T, 1536] --down_proj--> + x

q, k and v come out of one fused matrix (`qkv_proj`), gate and up out of another (`gate_up_proj`),
as in vLLM: one large GEMM instead of three small ones. `load_weights` fills them from a checkpoint's
separate q_proj/k_proj/v_proj and gate_proj/up_proj tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers import Attention, AttentionMetadata, RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:  # Qwen3: normalise each head's query and key before rotating them
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, config.sliding_windows[layer])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_metadata: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *cos_sin)  # cos/sin of these positions, looked up once per forward
        return self.o_proj(self.attn(q, k, v, positions, attn_metadata))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden] -> [T, 2I] -> [T, I] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, x, residual, attn_metadata, cos_sin):
        # The residual stream is carried separately so each norm can fuse "add, then normalise".
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn_metadata, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, attn_metadata):
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)  # [T, 1, head_dim] each, shared by all layers
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn_metadata, cos_sin)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, which shard)
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata):
        """input_ids, positions: [T] -> hidden states [T, hidden] (logits only where they are needed)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab], fp32 for the sampler

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs in Hugging Face naming into the model; returns the names loaded.

        Every parameter must be filled exactly once (a fused one once per shard): a missing or
        misshapen tensor is an error, never silently random weights.
        """
        params = dict(self.named_parameters())
        done: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, shard = name, None
            for fused, part, which in self.stacked_params:
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), which
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            dst = param.data if shard is None else self._shard(param.data, target, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            done.add(name if shard is None else f"{target}:{shard}")
        self._check_complete(done)
        return done

    def _shard(self, data: torch.Tensor, name: str, shard) -> torch.Tensor:
        if "qkv_proj" in name:
            c = self.config
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:
            size = self.config.intermediate_size
            start = shard * size
        return data.narrow(0, start, size)

    def _check_complete(self, done: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if "qkv_proj" in name:
                expected |= {f"{name}:{s}" for s in "qkv"}
            elif "gate_up_proj" in name:
                expected |= {f"{name}:{s}" for s in (0, 1)}
            else:
                expected.add(name)
        missing = sorted(expected - done)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
