"""Speculative decoding (chapter 09): proposers guess k tokens per running sequence, the target model
verifies them all in one engine step (engine/llm_engine.py), the rejection sampler
(sampling/rejection_sampler.py) keeps the target's distribution exact.

    ngram.py        prompt lookup: copy what followed the last n tokens earlier in the sequence
    layer_skip.py   the target's first L' layers + its final norm and LM head (self-speculative)
    draft_model.py  a small model with the target's vocabulary and its own paged KV cache
    medusa.py       K heads on the target's last hidden state, one guess each (learned, part two)
    eagle.py        one decoder layer on the target's hidden states, drafting autoregressively
    train_drafter.py  self-distillation of both on the target's own generations
"""

from .config import SpeculativeConfig
from .metrics import SpecDecodeMetrics

__all__ = ["SpecDecodeMetrics", "SpeculativeConfig", "load_drafter", "make_proposer"]


def load_drafter(config: SpeculativeConfig, target):
    """The module a method drafts with, loaded before the pool is sized (its KV layers count per block):
    a draft model, Medusa heads or an EAGLE layer; None for the methods without one."""
    if config.method == "draft_model":
        from .draft_model import load_draft_model

        return load_draft_model(config, target)
    if config.method == "medusa":
        from .medusa import load_medusa

        return load_medusa(config, target)
    if config.method == "eagle":
        from .eagle import load_eagle

        return load_eagle(config, target)
    return None


def make_proposer(config: SpeculativeConfig, target, runner, sizes, draft_model=None):
    """The proposer a config names, for this target model and its engine's resolved sizes (the draft
    model of method "draft_model": loaded beforehand, load_draft_model, as the pool is sized with it;
    runner: the target's ModelRunner)."""
    if config.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(config)
    if config.method == "layer_skip":
        from .layer_skip import LayerSkipProposer

        return LayerSkipProposer(config, target, runner.block_size, sizes.device, runner.bind)
    if config.method == "medusa":
        from .medusa import MedusaProposer

        return MedusaProposer(draft_model, target)
    if config.method == "eagle":
        from .eagle import EagleProposer

        return EagleProposer(draft_model, runner.block_size, sizes)
    from .draft_model import DraftModelProposer

    return DraftModelProposer(draft_model, target, runner.block_size, sizes)
