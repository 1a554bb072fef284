"""Self-speculative drafting (layer skip): the target's first L' layers, then its final norm and LM
head, as the draft model. No second model, no extra weights, no extra KV cache.

The draft shares the target's paged KV cache for layers 0..L'-1, and that is exact, not a shortcut:
the K/V a layer l < L' writes for a token depend only on the tokens up to it passed through layers
0..l, the same computation in the draft and in the target. So

  * the draft reads, for every computed token, K/V the target wrote: nothing to catch up, ever;
  * drafting writes layers 0..L'-1 at positions c..c+k-1 (the last token and drafts 1..k-1), inside
    the slots the scheduler reserved for this step's verify (copy-on-write already done);
  * the verify pass then runs all layers on positions c..c+k and overwrites those same slots with
    the target's own values; rejected positions are past num_computed_tokens afterwards, never read,
    and written again when the sequence gets there.
"""

from __future__ import annotations

from .proposer import ModelProposer


class LayerSkipModel:
    """target.model's forward cut after num_layers layers (a Llama-shaped model: embed_tokens,
    rotary_emb, layers, norm), with the target's LM head."""

    def __init__(self, target, num_layers: int):
        body = getattr(target, "model", None)
        if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
            raise ValueError(f"speculative_config method 'layer_skip' needs a Llama-shaped model (model.embed_tokens, "
                             f".rotary_emb, .layers, .norm); {type(target).__name__} is not one")
        total = len(body.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"speculative_config num_draft_layers must be in [1, {total - 1}] for this "
                             f"{total}-layer model, not {num_layers}")
        self.target, self.body, self.num_layers = target, body, num_layers

    def __call__(self, input_ids, positions, attn_metadata):
        body = self.body
        x, residual = body.embed_tokens(input_ids), None  # [T, hidden]
        cos_sin = body.rotary_emb.cos_sin(positions, x.dtype)
        for layer in body.layers[: self.num_layers]:
            x, residual = layer(positions, x, residual, attn_metadata, cos_sin)
        x, _ = body.norm(x, residual)
        return x  # [T, hidden]

    def compute_logits(self, hidden):
        return self.target.compute_logits(hidden)


class LayerSkipProposer(ModelProposer):
    method = "layer_skip"

    def __init__(self, config, target, block_size: int, device, bind):
        super().__init__(LayerSkipModel(target, config.num_draft_layers), block_size, device, target.config.vocab_size)
        self.bind = bind  # the target runner's: the draft's layers are the target's, on its pool

    def start(self, seq):
        return seq.num_computed_tokens  # the target wrote layers < L' for every computed token
