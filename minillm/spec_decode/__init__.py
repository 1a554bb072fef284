"""Speculative decoding (chapter 09): proposers guess k tokens per running sequence, the target model
verifies them all in one engine step (engine/llm_engine.py), the rejection sampler
(sampling/rejection_sampler.py) keeps the target's distribution exact.

    ngram.py        prompt lookup: copy what followed the last n tokens earlier in the sequence
    layer_skip.py   the target's first L' layers + its final norm and LM head (self-speculative)
    draft_model.py  a small model with the target's vocabulary and its own paged KV cache
"""

from .config import SpeculativeConfig
from .metrics import SpecDecodeMetrics

__all__ = ["SpecDecodeMetrics", "SpeculativeConfig", "make_proposer"]


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
    from .draft_model import DraftModelProposer

    return DraftModelProposer(draft_model, target, runner.block_size, sizes)
