"""Greedy decoding with a model split across the group's ranks: the smallest tensor-parallel generate.

Every rank runs the same forward on its own shard: its query and KV heads (and their KV cache), its
slice of the FFN and of the vocabulary. The row-parallel layers' all-reduces make each rank's hidden
state whole again after every attention and MLP block. The LM head's logits are gathered to rank 0
only; rank 0 picks the token and broadcasts it, so every rank feeds the same token to its next step.

    run_ranks(decode_rank, 2, folder, prompt_ids, 16)   # chapter 11's notebook: spawned ranks, gloo on CPU

The engine does the same through its multi-process executor, where the step's message is plain data.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..cache import KVCache
from ..generation import prepare_inputs
from ..loader import load_model
from .communication_op import broadcast
from .parallel_state import get_tp_group


@torch.inference_mode()
def greedy_decode(model, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One sequence, greedy, with a KV cache, on every rank of the group (or in one process) ->
    {"tokens": the new tokens, "steps_with_logits": how many steps this rank received logits on (all on
    rank 0, none elsewhere), "min_margin": the smallest gap between the top two logits over the steps
    (rank 0; a near-tie may rightly go either way when the sums are split differently)}."""
    device = next(model.parameters()).device
    seq = SimpleNamespace(token_ids=list(prompt_ids))
    cache = KVCache.for_model(model, 1, len(prompt_ids) + max_new_tokens)  # this rank's KV heads only
    cache.bind(model)
    slot, done, with_logits, margin = cache.allocate(), 0, 0, float("inf")
    try:
        for _ in range(max_new_tokens):
            ids, pos, meta = prepare_inputs([seq], [slot], [done], cache, device)  # prefill, then one token
            logits = model.compute_logits(model(ids, pos, meta)[meta.last_token_indices])  # [1, V] on rank 0, or None
            done = len(seq.token_ids)
            token = torch.zeros(1, dtype=torch.long, device=device)
            if logits is not None:
                with_logits += 1
                top2 = logits[0].topk(2).values  # [2]
                margin = min(margin, (top2[0] - top2[1]).item())
                token = logits.argmax(-1)  # [1]
            broadcast(token, src=0)  # rank 0's choice on every rank
            seq.token_ids.append(int(token))
    finally:
        cache.unbind(model)
    return {"tokens": seq.token_ids[len(prompt_ids):], "steps_with_logits": with_logits, "min_margin": margin}


def decode_rank(rank: int, world_size: int, folder: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """A spawned rank: load only this rank's shard of the checkpoint in `folder`, decode greedily, and
    report what it holds. -> greedy_decode's dict and "shard": {layer: this rank's weight shape}."""
    assert get_tp_group().rank == rank and get_tp_group().world_size == world_size
    model, _, _ = load_model(folder, tokenizer=False)
    layer = model.model.layers[0]
    shard = {name: tuple(m.weight.shape) for name, m in (
        ("embed_tokens", model.model.embed_tokens), ("qkv_proj", layer.self_attn.qkv_proj),
        ("o_proj", layer.self_attn.o_proj), ("gate_up_proj", layer.mlp.gate_up_proj),
        ("down_proj", layer.mlp.down_proj), ("lm_head", model.lm_head))}
    return greedy_decode(model, prompt_ids, max_new_tokens) | {"shard": shard}
