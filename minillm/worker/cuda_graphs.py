"""CUDA graphs of engine steps (chapter 07).

A step of a small model is a few hundred short kernels, and on a fast GPU launching them from
Python costs far more than running them. A CUDA graph records the launches once; a replay runs them
all from one call. Every step whose shape fits a captured one replays a graph:

* a pure decode step (every sequence brings one token) of b sequences replays the graph of the
  smallest captured batch size >= b (`cuda_graph_sizes`); these are captured when the engine starts;
* a step that carries prompt tokens (a prefill chunk, alone or beside decodes) of T tokens replays the
  graph of the smallest token bucket >= T (`token_buckets`), captured the first time a step needs it,
  or all at once by `LLMEngine.warm_up` (a warmed-up engine never captures while it serves: a
  capture synchronises, and its activations come out of the memory the KV pool left free).

A graph replays fixed kernels on fixed addresses with fixed launch grids, so its inputs live in
static buffers sized for the largest shape, and a smaller step is padded to its graph's shape:

* padding tokens write nowhere (slot -1) and their rows are never read;
* a decode graph's padding sequences have one query token and one key in block 0, which no sequence
  owns (chapter 05); a mixed graph's padding sequences have no tokens at all (cu_seqlens repeats T);
* the attention kernel of a mixed graph is launched as if a sequence could hold all T_pad tokens
  (max_seqlen = T_pad): its programs for tiles past a sequence's end return at once.

With LoRA (chapter 16) every graph also reads a static [T_pad] buffer of adapter slots, one per
token (-1: none, padding included), through the forward context; the LoRA layers' kernels index
the adapters' slot buffers with it, so one graph serves every mix of adapters.

The step's logits, at the rows its `logits_indices` name (at most one per sequence of a decode
shape; up to logits_per_seq per sequence of a mixed one: chapter 09's verify wants the last token's
and one per draft token, so a step with drafts replays a token bucket's graph; more runs eagerly),
are copied into one static [max logits rows, vocab] buffer inside every graph, so the graphs' intermediate tensors can all share one memory pool. Padding rows hold garbage (attention
never writes them), which is harmless only because every other layer treats token rows
independently; a layer that mixes tokens (a capacity-limited MoE router, say) would have to mask them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..forward_context import set_forward_context
from ..layers import AttentionMetadata


def cuda_graph_sizes(max_num_seqs: int, cuda_graph_max_batch: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 (a batch of b replays
    the smallest size >= b, padded), and the largest batch the scheduler can form itself, so that a
    max_num_seqs (or cap) between two steps, e.g. 24, does not leave its biggest batches eager."""
    top = min(max_num_seqs, cuda_graph_max_batch)
    return sorted({b for b in (1, 2, 4, 8, *range(16, top, 16)) if b < top} | {top})


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture steps with prompt tokens at: powers of two from 16 to 512 (padding a
    small step costs little), then every multiple of 512 (fewer than 512 padding tokens on a big one),
    and max_tokens itself. [] for max_tokens 0 (such steps run eagerly)."""
    if max_tokens < 1:
        return []
    small = [t for t in (16, 32, 64, 128, 256, 512) if t < max_tokens]
    return sorted({*small, *range(1024, max_tokens, 512), max_tokens})


class Shape(NamedTuple):
    tokens: int  # T_pad: rows of the packed token stream
    seqs: int  # S_pad: sequences (cu_seqlens has seqs + 1 entries)
    max_seqlen: int  # 1 for a decode graph (flash_decode), T_pad for a mixed one (flash_attn)


class StepGraphs:
    """Static input buffers and one replayable step per captured Shape.

    With capture=False (a CPU, or a test) the "graphs" are the same forward passes over the same padded
    buffers, run eagerly: the padding is then checked on any device against the unpadded path."""

    def __init__(self, model, device: torch.device, decode_sizes: list[int], buckets: list[int],
                 max_num_seqs: int, max_blocks_per_seq: int, capture: bool = True, logits_per_seq: int = 1,
                 lora: bool = False, keep_hidden: bool = False):
        self.model, self.device, self.capture = model, device, capture
        # chapter 09, part two: every token's final hidden state copied out too (a learned drafter's input)
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # [max tokens, hidden], made by the first capture
        self.logits_per_seq = logits_per_seq  # 1 + k with speculative decoding (k draft tokens a sequence)
        self.decode_sizes, self.buckets, self.max_num_seqs = decode_sizes, buckets, max_num_seqs
        T = max([*decode_sizes, *buckets])
        S = max([*decode_sizes, *(min(max_num_seqs, t) for t in buckets)])
        # rows: ids, positions, slots, logits rows, and (overlap) the rows taking the last step's tokens
        # and which of its tokens each takes
        self.tokens = torch.zeros(6, T, dtype=torch.int64, device=device)
        self.seqs = torch.ones(2, S + 1, dtype=torch.int32, device=device)  # rows: seq_lens, cu_seqlens
        self.table = torch.zeros(S, max_blocks_per_seq, dtype=torch.int32, device=device)
        # chapter 16: each token's adapter slot, -1 for none (None: the model has no LoRA layers)
        self.lora_slots = torch.full((T,), -1, dtype=torch.int32, device=device) if lora else None
        self.logits: torch.Tensor | None = None  # [max logits rows, vocab] fp32, made by the first capture
        shapes = [Shape(b, b, 1) for b in decode_sizes] + [Shape(t, min(max_num_seqs, t), t) for t in buckets]
        self.max_logits = max(self.logits_rows(s) for s in shapes)
        self.steps: dict[Shape, Callable[[], None]] = {}
        self.replays: Counter[Shape] = Counter()  # steps served per shape (captures not counted)
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape_for(self, num_tokens: int, num_seqs: int, num_logits: int | None = None) -> Shape | None:
        """The captured (or capturable) shape this step pads to; None: too big, or more logits rows
        than sequences (several per sequence: chapter 09's drafts), run it eagerly."""
        if num_tokens == num_seqs:  # pure decode
            i = bisect.bisect_left(self.decode_sizes, num_seqs)
            shape = Shape(self.decode_sizes[i], self.decode_sizes[i], 1) if i < len(self.decode_sizes) else None
        else:
            i = bisect.bisect_left(self.buckets, num_tokens)
            t = self.buckets[i] if i < len(self.buckets) else None
            shape = Shape(t, min(self.max_num_seqs, t), t) if t else None  # num_seqs <= max_num_seqs, <= T <= t
        if shape is None or (num_logits or 0) > self.logits_rows(shape):
            return None
        return shape

    def logits_rows(self, shape: Shape) -> int:
        """Logits rows a shape's graph computes: one per sequence of a decode shape; for a mixed shape
        logits_per_seq per sequence, at most one per token (1 + k each: the verify of k drafts)."""
        return shape.seqs if shape.max_seqlen == 1 else min(shape.tokens, shape.seqs * self.logits_per_seq)

    def run(self, shape: Shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices,
            prev: tuple[list[int], list[int], torch.Tensor] | None = None,
            lora_slots: list[int] | None = None) -> torch.Tensor:
        """Copy one step's inputs (ModelRunner.prepare's lists; query_lens: new tokens per sequence;
        logits_indices: the token rows that want logits) into the buffers, padded to shape, and replay
        (capturing first if this shape is new); -> logits [len(logits_indices), vocab], valid until the
        next run. prev = (dst rows, src rows, the previous step's sampled tokens on the device): overlap
        scheduling's rows whose token ids only the GPU knows (chapter 13); their row numbers travel in
        the same host-to-device copy as the ids, and two small kernels move the tokens. lora_slots: each
        token's adapter slot (chapter 16; None: none has one)."""
        dst, src, prev_tokens = prev if prev is not None and prev[0] else ([], [], None)
        self._fill(shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices, dst, src)
        if self.lora_slots is not None:
            T = len(ids)
            host = torch.tensor((lora_slots or [-1] * T) + [-1] * (shape.tokens - T), dtype=torch.int32)
            self.lora_slots[: shape.tokens].copy_(host, non_blocking=True)
        if dst:
            P = len(dst)
            self.tokens[0].index_copy_(0, self.tokens[4, :P], prev_tokens.index_select(0, self.tokens[5, :P]))
        step = self.steps.get(shape) or self._capture(shape)
        step()
        self.replays[shape] += 1
        return None if self.logits is None else self.logits[: len(logits_indices)]  # None: TP rank > 0

    def _fill(self, shape: Shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices,
              dst: list[int] = (), src: list[int] = ()) -> None:
        T, S = len(ids), len(seq_lens)
        tp, sp = shape.tokens, shape.seqs
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        # padding: decode rows have one token each (cu keeps counting); mixed ones have none (cu stays T)
        cu += range(T + 1, T + 1 + sp - S) if shape.max_seqlen == 1 else [T] * (sp - S)
        pad_t = tp - T
        rows = logits_indices + [0] * (tp - len(logits_indices))  # padding rows read token 0, never used
        pad_p = [0] * (tp - len(dst))
        host_tokens = torch.tensor([ids + [0] * pad_t, pos + [0] * pad_t, slots + [-1] * pad_t, rows,
                                    [*dst, *pad_p], [*src, *pad_p]])  # [6, tp]
        host_seqs = torch.tensor([seq_lens + [1] * (sp - S + 1), cu], dtype=torch.int32)  # [2, sp + 1]
        host_table = torch.zeros(sp, len(table[0]), dtype=torch.int32)  # [sp, width]; padding rows: block 0
        host_table[:S] = torch.as_tensor(table, dtype=torch.int32)  # the worker's numpy gather, or lists
        width = host_table.shape[1]
        self.tokens[:, :tp].copy_(host_tokens, non_blocking=True)
        self.seqs[:, : sp + 1].copy_(host_seqs, non_blocking=True)
        self.table[:sp, :width].copy_(host_table, non_blocking=True)

    def _capture(self, shape: Shape) -> Callable[[], None]:
        T, S, R = shape.tokens, shape.seqs, self.logits_rows(shape)
        ids, pos, slots, rows = self.tokens[0, :T], self.tokens[1, :T], self.tokens[2, :T], self.tokens[3, :R]
        seq_lens, cu = self.seqs[0, :S], self.seqs[1, : S + 1]
        meta = AttentionMetadata(cu_seqlens=cu, max_seqlen=shape.max_seqlen, seq_lens=seq_lens,
                                 block_table=self.table[:S], slot_mapping=slots)
        lora_mapping = self.lora_slots[:T] if self.lora_slots is not None else None  # [T] static

        def forward() -> torch.Tensor:
            # read at capture; what a layer takes from it is a static buffer
            with set_forward_context(meta, lora_mapping=lora_mapping):
                hidden = self.model(ids, pos, meta)  # [T, hidden]
            if self.keep_hidden:
                if self.hidden is None:  # at the first warm-up, outside any capture
                    self.hidden = torch.empty(self.tokens.shape[1], hidden.shape[-1], dtype=hidden.dtype,
                                              device=self.device)
                self.hidden[:T].copy_(hidden)
            return self.model.compute_logits(hidden[rows])  # [R, vocab] at the step's logits_indices

        # Warm-up, outside the capture: Triton compiles and autotunes here. It runs on the inputs in the
        # buffers: dummies at start-up, or the step being served (writing its K/V twice is harmless).
        logits = forward()
        if logits is None:  # a tensor-parallel rank other than 0 (chapter 11): it sends its slice, keeps none
            def step() -> None:
                forward()
        else:
            if self.logits is None:
                self.logits = torch.empty(self.max_logits, logits.shape[-1], dtype=logits.dtype, device=self.device)
            out = self.logits[:R]

            def step() -> None:
                out.copy_(forward())
        if not self.capture:
            self.steps[shape] = step
            return step
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.steps[shape] = graph.replay
        return graph.replay

    def capture_decode(self, progress: bool = True) -> None:
        """Capture every decode size now (largest first: the pool grows once), on dummy inputs: slot -1
        (nothing written), one key in block 0."""
        from tqdm.auto import tqdm

        for b in tqdm(sorted(self.decode_sizes, reverse=True), desc="capturing CUDA graphs", disable=not progress):
            self._dummy(Shape(b, b, 1), [1] * b)

    def capture_buckets(self, max_model_len: int) -> None:
        """Capture every token bucket not captured yet (largest first), on dummy prompts that fill the
        bucket: sequences of up to max_model_len tokens (their keys must fit a block table), all at
        position 0, writing nothing and reading block 0. The attention kernel autotunes on them as on
        a long prompt. A bucket that would need more sequences than max_num_seqs cannot occur."""
        for t in sorted(self.buckets, reverse=True):
            shape = Shape(t, min(self.max_num_seqs, t), t)
            lens = [min(max_model_len, t - i) for i in range(0, t, max_model_len)]
            if shape not in self.steps and len(lens) <= shape.seqs:
                self._dummy(shape, lens)

    def _dummy(self, shape: Shape, lens: list[int]) -> None:
        t, width = sum(lens), self.table.shape[1]
        self._fill(shape, [0] * t, [0] * t, [-1] * t, lens, [[0] * width] * len(lens), lens, [])
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)  # no adapter for the dummies
        self._capture(shape)

    def clear(self) -> None:
        self.steps.clear()
        self.replays.clear()
        self.logits = self.hidden = None
