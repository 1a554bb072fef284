"""Kernels per decode layer, counted from the code (chapter 13: at batch 1 a small model's step costs
about a launch per kernel, so the count is the figure to bring down).

    preset_model(name, layers)           a preset's real shapes, dummy weights, cut to a few layers
    decode_step(model, batch, context)   a paged KV cache bound to the model, one decode step's inputs
                                         (padding rows with slot -1 when pad > 0), and a closure that
                                         runs the forward pass and the logits of the real rows
    cpu_launches(step)                   on a CPU: the Triton launches (the interpreter's) plus every
                                         aten op that would launch a GPU kernel (views and empty
                                         allocations launch none), by name
    gpu_kernels(step)                    on a GPU: the CUDA kernels (and memcpy/memset) that one replay
                                         of the step captured as a CUDA graph runs, from torch.profiler
    per_layer(counts_a, counts_b, la, lb)  (b - a) / (lb - la): what one more decoder layer adds,
                                         the per-step work (embedding, final norm, lm_head) cancelled

Used by tests/test_fused_decode_layer.py (CPU, and GPU when there is one) and scripts/gpu/fused_decode.py.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.layers import AttentionMetadata
from minillm.layers.attention import Attention

# aten ops that allocate or reinterpret memory without a kernel of their own
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "set_", "resize_", "promote_types"}


def preset_model(name: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda"):
    """A preset's real shapes (minillm/config.py PRESETS) with dummy weights, cut to `layers` layers."""
    from minillm.config import preset
    from minillm.loader import load_model

    config = preset(name)
    if layers is not None:
        config = config.with_(num_layers=layers, sliding_windows=config.sliding_windows[:layers])
    model, _, _ = load_model(config, load_format="dummy", dtype=dtype, device=torch.device(device))
    return model


def decode_step(model, batch: int, context: int, *, block_size: int = 16, pad: int = 0, seed: int = 0,
                kv_dtype: torch.dtype | None = None):
    """Bind a random paged cache (room for `context` keys a sequence) and make one decode step of
    `batch` sequences (the first `pad` of them padding rows: slot -1). -> step() returning logits."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1  # block 0 belongs to no sequence (padding rows read it)
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        k, v = (torch.randn(shape, generator=g).to(device, kv_dtype or dtype) for _ in range(2))
        layer.kv_cache = (k, v)
    table = (1 + torch.randperm(num_blocks - 1, generator=g)[: batch * blocks_per_seq]).view(batch, -1)
    seq_lens = torch.randint(1, context + 1, (batch,), generator=g)
    positions = seq_lens - 1  # the new token is the last of its sequence
    slots = table.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    slots[:pad] = -1
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch,), generator=g)
    meta = AttentionMetadata(cu_seqlens=torch.arange(batch + 1, dtype=torch.int32, device=device), max_seqlen=1,
                             seq_lens=seq_lens.to(device, torch.int32), block_table=table.to(device, torch.int32),
                             slot_mapping=slots.to(device))
    ids, positions = ids.to(device), positions.to(device)

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, positions, meta))  # [batch, vocab]

    return step


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _NO_KERNEL:
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def cpu_launches(step) -> Counter[str]:
    """Run step() once (Triton under its interpreter) and count what would be launched on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    mode = _Launches()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        mode.counts[f"triton.{self.fn.__name__}"] += 1
        mode.paused += 1  # the interpreter's own tensor copies are not the kernel's
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    InterpretedFunction.run = counted
    try:
        with torch.inference_mode(), mode:
            step()
    finally:
        InterpretedFunction.run = run
    return mode.counts


def gpu_kernels(step, replays: int = 3) -> Counter[str]:
    """Capture step() as a CUDA graph (after an eager warm-up that compiles and autotunes) and count
    the device activities of one replay, by kernel name (the median count over `replays` replays)."""
    import warnings

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        runs = []
        for _ in range(replays):
            with warnings.catch_warnings(), contextlib.ExitStack() as stack:
                warnings.simplefilter("ignore")
                prof = stack.enter_context(profile(activities=[ProfilerActivity.CUDA]))
                graph.replay()
                torch.cuda.synchronize()
            runs.append(Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA))
    runs.sort(key=lambda c: sum(c.values()))
    return runs[len(runs) // 2]


def per_layer(counts_a: Counter, counts_b: Counter, layers_a: int, layers_b: int) -> float:
    return (sum(counts_b.values()) - sum(counts_a.values())) / (layers_b - layers_a)
