"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens.

It keeps its own paged KV cache in the same engine, with the *same block ids* as the target: block b
of a sequence's table holds the target's K/V in the target's pool and the draft's in the draft's
pool. The block manager, the scheduler's allocation, preemption and copy-on-write then serve both,
and the draft's pool is sized with the target's (EngineConfig.resolve counts both per block).

What the draft has computed is tracked per sequence (Sequence.num_draft_computed): the draft catches
up from there on each proposal (the whole prompt the first time, usually the last one or two tokens
afterwards). The scheduler resets it to 0 when a sequence is preempted (recomputed or swapped: the
draft's pool is not swapped, it is recomputed) or admitted (prefix-cache hits give the target's K/V,
not the draft's). The rollback after a verify cuts it to what was accepted. A catch-up over blocks
shared by copy-on-write or the prefix cache rewrites the same values the draft wrote there before.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cache import PagedKVCache, kv_cache_spec
from .proposer import ModelProposer


def load_draft_model(config, target):
    """The draft model a SpeculativeConfig names (a path or model name, loaded like the target: same
    dtype and device; or a built model), checked against the target."""
    param = next(target.parameters())
    model = config.model
    if isinstance(model, (str, Path)):
        from ..loader import load_model

        model, _, _ = load_model(str(model), dtype=param.dtype, device=param.device)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "compute_logits"):
        raise TypeError(f"speculative_config model must be a path or a minillm model, not {type(model).__name__}")
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config model: the draft's vocabulary ({model.config.vocab_size} tokens) "
                         f"differs from the target's ({target.config.vocab_size}); they must share the tokenizer")
    draft_device = next(model.parameters()).device
    if draft_device != param.device:
        raise ValueError(f"speculative_config model is on {draft_device}, the target on {param.device}")
    return model


class DraftModelProposer(ModelProposer):
    method = "draft_model"

    def __init__(self, model, target, block_size: int, sizes):
        if model.config.max_position_embeddings < sizes.max_model_len:
            raise ValueError(f"speculative_config model: the draft's context ({model.config.max_position_embeddings}) "
                             f"is shorter than the engine's max_model_len ({sizes.max_model_len}); lower max_model_len")
        super().__init__(model, block_size, sizes.device, target.config.vocab_size)
        self.cache = PagedKVCache(kv_cache_spec(model), sizes.num_gpu_blocks, block_size, sizes.device)
        self.cache.bind(model)

    def bind(self):
        self.cache.bind(self.model)  # cheap: a pointer per layer (nobody else uses the draft, but be sure)

    def start(self, seq):
        return seq.num_draft_computed

    def drafted(self, seq, num_drafts):
        seq.num_draft_computed = seq.num_tokens - 1 + num_drafts

    def copy_blocks(self, pairs):
        self.cache.copy_blocks(pairs)
