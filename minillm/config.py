"""ModelConfig: every number the forward pass needs, read from a GGUF header or a config.json.

The fields every decoder-only transformer has come first; a family with more to say carries it in
an optional sub-config (`moe` for routed experts, `mla` for latent attention), so adding a family
never changes what a Llama config holds. Which model file serves an architecture is the registry's
business (models/registry.py). Within the Llama family the members differ in a few switches:

    llama   (Llama 2/3)  optional llama3 RoPE scaling, optional attention/MLP biases
    mistral              a sliding attention window
    qwen2                biases on q, k and v (not o); sliding window on some layers, if enabled
    qwen3                RMSNorm on each query and key head (q_norm, k_norm); head_dim set explicitly
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .checks import check_int
from .models.registry import hf_architectures, model_type_of, model_types

ROPE_TYPES = ("default", "llama3", "yarn")  # yarn: DeepSeek-V2/V3 (layers/mla.py)
# Sanity bounds, checked before anything is allocated: a few times the largest real models' (Llama-3
# 405B: 126 layers, hidden 16384, FFN 53248; Gemma: vocab 256k; DeepSeek-V3: 256 experts; 10M-token
# contexts). A config past one is a typo or a hostile file, which would otherwise allocate for minutes
# and die with an allocator error naming no field.
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19, "num_layers": 1024,
          "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24}
MOE_LIMITS = {"num_experts": 4096, "num_experts_per_tok": 256, "moe_intermediate_size": 1 << 19,
              "num_shared_experts": 64}
MLA_LIMITS = {"kv_lora_rank": 1 << 14, "qk_nope_head_dim": 1024, "qk_rope_head_dim": 1024, "v_head_dim": 1024,
              "q_lora_rank": 1 << 16}


def check_limits(obj, limits: dict[str, int], prefix: str) -> None:
    for name, limit in limits.items():
        value = getattr(obj, name)
        if value is not None and value > limit:
            raise ValueError(f"{prefix}{name}={value} is beyond what minillm accepts ({limit:,}); "
                             f"a config that large is a mistake (or not a model this engine can hold)")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass
class MoEConfig:
    """Routed experts (Mixtral, Qwen-MoE, DeepSeek): each token runs top_k of num_experts MLPs."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    num_shared_experts: int = 0  # experts every token runs (DeepSeek, Qwen2-MoE)
    scoring_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    routed_scaling_factor: float = 1.0
    # greedy: the top_k of all experts; group_limited_greedy (DeepSeek-V2) and noaux_tc (V3, with a
    # score-correction bias): only from the topk_group best of n_group expert groups (layers/moe.py)
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    dense_layers: tuple[int, ...] = ()  # layers that run an ordinary MLP instead (DeepSeek's first_k_dense_replace)

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            check_int(name, getattr(self, name), prefix="config moe.")
        check_int("num_shared_experts", self.num_shared_experts, 0, prefix="config moe.")
        check_limits(self, MOE_LIMITS, "config moe.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config moe.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"config moe.scoring_func must be one of {', '.join(SCORING_FUNCS)}, "
                             f"not {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config moe.topk_method must be one of {', '.join(TOPK_METHODS)}, "
                             f"not {self.topk_method!r}")
        self.dense_layers = tuple(self.dense_layers)
        if self.topk_method != "greedy":
            check_int("n_group", self.n_group, prefix="config moe.")
            check_int("topk_group", self.topk_group, prefix="config moe.")
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ValueError(f"config moe: n_group ({self.n_group}) must divide num_experts ({self.num_experts}) "
                                 f"and topk_group ({self.topk_group}) must be <= n_group")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(f"config moe.num_experts_per_tok ({self.num_experts_per_tok}) must be <= the "
                                 f"experts of topk_group ({self.topk_group}) groups")
            if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
                raise ValueError("config moe: noaux_tc scores a group by its best two experts; "
                                 f"{self.num_experts} experts in {self.n_group} groups leave fewer")


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from one cached latent per token."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q is projected directly, without a low-rank bottleneck
    # RoPE pairs coordinates (2i, 2i+1) (DeepSeek's checkpoints) instead of (i, i + d/2) (Llama's)
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(name, getattr(self, name), prefix="config mla.")
        check_int("q_lora_rank", self.q_lora_rank, optional=True, prefix="config mla.")
        check_limits(self, MLA_LIMITS, "config mla.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config mla.qk_rope_head_dim must be even for rotary embeddings, "
                             f"not {self.qk_rope_head_dim}")


@dataclass
class ModelConfig:
    architecture: str  # the model type: llama | mistral | qwen2 | qwen3 | any registered one
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # per layer: the attention window in tokens, or None for full causal attention
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    def __post_init__(self):
        check_int("num_layers", self.num_layers, prefix="config ")  # before a list of that length is made
        check_limits(self, {"num_layers": LIMITS["num_layers"]}, "config ")
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        self.validate()

    def validate(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings"):
            check_int(f, getattr(self, f), prefix="config ")
        check_limits(self, LIMITS, "config ")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, not {self.head_dim}")
        if self.architecture not in model_types():
            raise ValueError(f"architecture {self.architecture!r} is not supported; supported: {model_types()}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if rope_type == "yarn" and self.mla is None:
            raise ValueError("rope scaling 'yarn' is supported for latent-attention (DeepSeek) models only")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    @property
    def num_params(self) -> int:
        """Parameter count of the model this config builds (a tied embedding counted once): the model
        is built on the "meta" device, which allocates nothing, and its parameters are counted."""
        import torch

        from .models.registry import get_model_class

        with torch.device("meta"):
            model = get_model_class(self.architecture)(self)
        return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once

    def as_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)

    # ---- readers -------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None, name: str = "") -> ModelConfig:
        """From a Hugging Face config.json (transformers 4 or 5 layout)."""
        archs = cfg.get("architectures") or []
        arch = model_type_of(archs, cfg.get("model_type"))
        if arch is None:
            raise ValueError(f"model {archs or cfg.get('model_type')!r} is not supported; supported: {hf_architectures()}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        mla = _mla_config(cfg, arch)
        if mla is not None:  # the only per-head dim RoPE sees (transformers sets head_dim the same way)
            head_dim = mla.qk_rope_head_dim
        # transformers 5 writes rope_parameters={"rope_theta":..., "rope_type":...}; 4 wrote rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope or cfg.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        layers = cfg["num_hidden_layers"]
        eos = (generation_config or {}).get("eos_token_id", cfg.get("eos_token_id"))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(arch, cfg, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            name=name,
            moe=_moe_config(cfg, arch, layers),
            mla=mla,
        )

    @classmethod
    def from_gguf(cls, meta: dict, name: str = "") -> ModelConfig:
        """From a GGUF header (llama.cpp's key names: '{arch}.block_count', ...)."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} is not supported; minillm reads 'llama' GGUF files")

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        def positive(key, value, kind=int):
            # a bad value must be named here, with its key: 0 heads divided by zero below, and a NaN or
            # negative rope base / epsilon loaded fine, then made every logit NaN (probe round 4, m5)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok or (kind is int and value != int(value)):
                what = "a positive int" if kind is int else "a positive finite number"
                raise ValueError(f"{arch}.{key}={value!r} must be {what}")
            return kind(value)

        heads = positive("attention.head_count", get("attention.head_count"))
        hidden = positive("embedding_length", get("embedding_length"))
        context = positive("context_length", get("context_length"))
        if context < 2:
            raise ValueError(f"{arch}.context_length={context}: a context must hold a prompt token and a new one")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture="llama",
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(heads),
            num_kv_heads=positive("attention.head_count_kv", get("attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            max_position_embeddings=context,
            rms_norm_eps=positive("attention.layer_norm_rms_epsilon", get("attention.layer_norm_rms_epsilon", 1e-5),
                                  float),
            rope_theta=positive("rope.freq_base", get("rope.freq_base", 10000.0), float),
            tie_word_embeddings=True,  # corrected by the loader when the file has output.weight
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            name=name or str(meta.get("general.name", "")),
        )


def _moe_config(cfg: dict, arch: str, layers: int) -> MoEConfig | None:
    """Routed experts, under the names the families use (Mixtral: num_local_experts; Qwen-MoE:
    num_experts; DeepSeek: n_routed_experts), and which layers keep a dense MLP."""
    n = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if not n:
        return None
    if arch.startswith("deepseek"):  # layers >= first_k_dense_replace, every moe_layer_freq-th, are MoE
        first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        dense = [i for i in range(layers) if i < first or i % freq]
    else:  # Qwen-MoE: mlp_only_layers, and a MoE layer every decoder_sparse_step layers
        step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
    v3 = arch == "deepseek_v3"  # transformers' V3 always routes by sigmoid, groups and a correction bias
    return MoEConfig(num_experts=n, num_experts_per_tok=cfg["num_experts_per_tok"],
                     moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     num_shared_experts=cfg.get("n_shared_experts") or 0,
                     scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                     topk_method=cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
                     n_group=cfg.get("n_group") or (1 if v3 else None),
                     topk_group=cfg.get("topk_group") or (1 if v3 else None), dense_layers=tuple(dense))


def _mla_config(cfg: dict, arch: str) -> MLAConfig | None:
    if not cfg.get("kv_lora_rank"):
        return None
    mla = MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank"),
                    rope_interleave=arch != "deepseek_v3" or bool(cfg.get("rope_interleave", True)))
    qk_head_dim = cfg.get("qk_head_dim")
    if qk_head_dim is not None and qk_head_dim != mla.qk_nope_head_dim + mla.qk_rope_head_dim:
        raise ValueError(f"qk_head_dim ({qk_head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                         f"({mla.qk_nope_head_dim} + {mla.qk_rope_head_dim})")
    return mla


def _sliding_windows(arch: str, cfg: dict, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if window is None:
        return [None] * layers
    if "layer_types" in cfg:  # transformers 5 spells it out per layer
        return [window if t == "sliding_attention" else None for t in cfg["layer_types"]]
    if arch == "qwen2" or arch == "qwen3":  # older configs: a switch and the first layer that slides
        if not cfg.get("use_sliding_window", False):
            return [None] * layers
        first = cfg.get("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers  # mistral


# Real shapes for speed work with dummy weights (load_format="dummy"): from each model's config.json.
PRESETS = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True),
    "qwen3-0.6b": dict(architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, qk_norm=True),
    # the published megakernel's model (Hazy "No Bubbles", chapter 18): Llama-3.2-1B's config.json
    "llama-3.2-1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=5e5),
    # chapter 10: routed experts (Qwen3-30B-A3B fits an 80 GB GPU in bf16, Mixtral-8x7B needs about 94 GB)
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                          moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    "mixtral-8x7b": dict(architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1e6,
                         moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)),
    # latent attention (kv_lora_rank 512 + rope 64 cached per token and layer) and 64 routed + 2 shared experts
    "deepseek-v2-lite": dict(architecture="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_layers=27, num_heads=16, num_kv_heads=16, head_dim=64, max_position_embeddings=163840,
                             rms_norm_eps=1e-6, rope_theta=10000.0,
                             rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                           "mscale_all_dim": 0.707},
                             moe=MoEConfig(num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                                           norm_topk_prob=False, num_shared_experts=2, dense_layers=(0,)),
                             mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                           v_head_dim=128)),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig(**PRESETS[name], name=name)
