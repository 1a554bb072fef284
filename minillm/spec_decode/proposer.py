"""The proposer interface, and the drafting loop every model-based proposer shares.

A proposer is asked, once per engine step, for up to num_spec[i] draft tokens after the last token of
each running sequence i (the scheduler has already reserved their KV slots and token budget, and the
step's block copies have run). It returns the drafts, possibly fewer (an n-gram lookup may find
nothing), and q: the distribution each draft was sampled from, or None when the drafts have none.

A model drafts autoregressively: one pass over each sequence's tokens whose draft-side K/V are missing
(the "catch-up", ending on the last token: its logits give draft 1), then k - 1 passes of one token
each, batched over the sequences still drafting. Sampling follows each request's own parameters on a
stream of its seed kept apart from the target's (DRAFT_STREAM), so a seeded request drafts the same
tokens whatever the batch.
"""

from __future__ import annotations

import torch

from ..layers.backend import get_kernel_mode
from ..sampling import filtered_probs
from ..sampling.rejection_sampler import DRAFT_STREAM, race, spec_metadata
from ..sequence import Sequence, new_tokens
from ..worker.block_table import PersistentBlockTable
from ..worker.model_input import pack
from ..worker.model_runner import forward_packed


class Proposer:
    method = "base"

    def propose(self, seqs: list[Sequence], num_spec: list[int],
                tables: PersistentBlockTable) -> tuple[list[list[int]], torch.Tensor | None]:
        """-> (drafts per sequence, at most num_spec[i] each; q [sum of their lengths, vocab] or None).
        tables: the worker's block tables, this step's changes applied (the drafts' slots reserved)."""
        raise NotImplementedError

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The step's copy-on-write block copies (a proposer with its own KV cache mirrors them)."""


class ModelProposer(Proposer):
    """Drafting with a model: `model(ids, positions, meta)` -> hidden, `model.compute_logits(hidden)`."""

    def __init__(self, model, block_size: int, device, vocab_size: int):
        self.model, self.block_size, self.device, self.vocab_size = model, block_size, device, vocab_size
        self.graphs = None  # StepGraphs of the draft's own passes (set by the engine on a GPU)

    def start(self, seq: Sequence) -> int:
        """The first position whose K/V the draft model lacks (it reads everything before it)."""
        raise NotImplementedError

    def drafted(self, seq: Sequence, num_drafts: int) -> None:
        """After drafting: positions up to num_tokens - 1 + num_drafts - 1 hold the draft's K/V."""

    def bind(self) -> None:
        """Point the model's attention layers at the cache it drafts with."""

    @torch.inference_mode()
    def propose(self, seqs, num_spec, tables):
        self.bind()
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        any_random = any(s.params.temperature > 0 for s, k in zip(seqs, num_spec) if k)
        active = [i for i, k in enumerate(num_spec) if k > 0]
        # pass 0: the catch-up chunk of each sequence, up to and including its last token
        chunks = []
        for i in active:
            s = seqs[i]
            start = min(self.start(s), s.num_tokens - 1)
            chunks.append((start, new_tokens(s, start, s.num_tokens - start), tables.row(s.seq_id)))
        rows = {seqs[i].seq_id: c[2] for i, c in zip(active, chunks)}  # each table read once a step
        while active:
            lens = [len(c[1]) for c in chunks]
            last = torch.tensor(lens).cumsum(0).sub(1).tolist()  # each chunk's last row
            logits = self.forward(chunks, lens, last)  # [A, V]
            tokens, q = self.sample(logits, [seqs[i] for i in active], [len(drafts[i]) for i in active], any_random)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None:
                    qs[i].append(q[row])
            active = [i for i in active if len(drafts[i]) < num_spec[i]]
            # the next pass feeds draft j at position num_tokens - 1 + j (its slot was reserved)
            chunks = [(seqs[i].num_tokens - 1 + len(drafts[i]), drafts[i][-1:], rows[seqs[i].seq_id])
                      for i in active]
        for s, d in zip(seqs, drafts):
            if d:
                self.drafted(s, len(d))
        probs = torch.stack([q for row in qs for q in row]) if any_random and any(qs) else None  # [D, V]
        return drafts, probs

    def forward(self, chunks, lens: list[int], last: list[int]) -> torch.Tensor:
        """One draft pass: a captured graph when the shape fits (the one-token passes are decode
        shapes), else eagerly."""
        step = pack(chunks, self.block_size, last)
        graphs = self.graphs if get_kernel_mode() != "torch" else None
        shape = graphs.shape_for(step.num_tokens, len(chunks), len(last)) if graphs is not None else None
        if shape is not None:
            return graphs.run(shape, step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                              step.block_table, lens, last)
        return forward_packed(self.model, self.device, step)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int],
               any_random: bool) -> tuple[list[int], torch.Tensor | None]:
        return sample_drafts(logits, seqs, offsets, any_random)


def sample_drafts(logits: torch.Tensor, seqs: list[Sequence], offsets: list[int],
                  any_random: bool) -> tuple[list[int], torch.Tensor | None]:
    """logits [A, V]: each row by its request's parameters at output position len(output) + offset; -> the
    tokens and, when some request samples at random, q [A, V] (the filtered distributions sampled from)."""
    if not any_random:
        return logits.argmax(dim=-1).tolist(), None
    meta = spec_metadata([s.params for s in seqs], [s.seed ^ DRAFT_STREAM for s in seqs],
                         [len(s.output_ids) + o for s, o in zip(seqs, offsets)], [0] * len(seqs),
                         logits.shape[1], logits.device)
    q = filtered_probs(logits, meta)  # [A, V]
    tokens = torch.where(meta.temperature == 0, logits.argmax(dim=-1), race(q, meta.seeds, meta.steps))
    return tokens.tolist(), q
