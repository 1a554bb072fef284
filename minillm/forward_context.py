"""The per-step forward context: what every layer of one forward pass may read (vLLM's
`set_forward_context`; chapters 13, 16, 17).

A model's forward takes `(input_ids, positions, attn_metadata)`. That is all a dense model needs,
but some of what a step carries is not an argument every layer should thread through: the adapter
slot of each token (chapter 16, multi-LoRA: a linear layer adds its adapter's low-rank update) or a
KV connector that saves and loads one layer's cache while the next one computes (chapter 17). The
runner opens a context around the forward pass and a layer that needs it asks for it; a layer that
does not need it never sees it, and a model run outside the engine (a notebook, a test) runs with
no context, which such a layer reads as "nothing extra this step".

Under CUDA graphs the context is read while the graph is captured, never at replay: whatever a layer
takes from it must be a static buffer that the runner refills before each replay (as it refills the
token ids), not a Python value of the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    # layers.AttentionMetadata; not imported, not even for type checking: the layers import this module
    attn_metadata: Any
    # chapter 16: per-token adapter slots for the LoRA layers (a device tensor; static under graphs)
    lora_mapping: Any = None
    # chapter 17: the worker side of a KV connector (layer-wise save and load hooks)
    kv_connector: Any = None
    # anything else a later chapter hangs on a step, by name
    extras: dict[str, Any] = field(default_factory=dict)


_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, **fields: Any) -> Iterator[ForwardContext]:
    """Open the context of one forward pass; the previous one (a draft pass inside a step) comes back
    when it ends, also after an error."""
    global _context
    previous, _context = _context, ForwardContext(attn_metadata, **fields)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward pass running now; a RuntimeError outside one."""
    if _context is None:
        raise RuntimeError("no forward pass is running: get_forward_context() is for layers inside "
                           "one (the model runner opens it with set_forward_context)")
    return _context


def maybe_forward_context() -> ForwardContext | None:
    """The context, or None when the model runs outside the engine."""
    return _context
