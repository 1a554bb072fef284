"""The per-step forward context (issue 42, item 5): every layer of a forward pass the engine runs
sees the context the runner opened for that pass — on the eager path and on the CUDA-graph path's
padded buffers — and nothing leaks past the pass, not even after an error."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.forward_context import get_forward_context, maybe_forward_context, set_forward_context
from minillm.layers import AttentionMetadata


def _record_contexts(model) -> list[tuple[str, object, object]]:
    """A pre-hook on every decoder layer and attention module: (name, context's metadata, metadata
    the module was called with)."""
    seen: list[tuple[str, object, object]] = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("DecoderLayer") or kind == "Attention":
            def hook(mod, args, kwargs, name=name):
                meta = next((a for a in (*args, *kwargs.values()) if isinstance(a, AttentionMetadata)), None)
                ctx = maybe_forward_context()
                seen.append((name, None if ctx is None else ctx.attn_metadata, meta))
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-buffers"])
def test_every_layer_sees_the_context_of_its_pass(seed, tok, padded):
    model, _ = random_model(random.Random(seed))
    engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=32, max_num_seqs=4))
    if padded:
        engine.runner.graphs = engine.runner.make_graphs(capture=False)  # the graph path's buffers, eagerly
    seen = _record_contexts(model)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7, 8, 9][: 2 + i]}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    names = {name for name, *_ in seen}
    assert len(names) == 2 * len(model.model.layers), names  # each decoder layer and its attention
    for name, ctx_meta, meta in seen:
        assert ctx_meta is not None, f"{name} ran without a forward context"
        if meta is not None:  # the module was handed the pass's metadata: the context holds the same object
            assert ctx_meta is meta, name
    assert maybe_forward_context() is None  # closed after the steps


def test_contexts_nest_and_close_after_an_error():
    outer, inner = AttentionMetadata.from_seq_lens([3], "cpu"), AttentionMetadata.from_seq_lens([1], "cpu")
    with pytest.raises(RuntimeError, match="no forward pass is running"):
        get_forward_context()
    with set_forward_context(outer, lora_mapping=torch.zeros(3)) as ctx:
        assert get_forward_context() is ctx and ctx.lora_mapping.shape == (3,)
        with pytest.raises(ZeroDivisionError):
            with set_forward_context(inner):  # a draft pass inside a step
                assert get_forward_context().attn_metadata is inner
                assert get_forward_context().lora_mapping is None  # nothing inherited by accident
                raise ZeroDivisionError("a layer failed")
        assert get_forward_context() is ctx  # the outer pass's context is back
    assert maybe_forward_context() is None
