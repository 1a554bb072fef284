"""Medusa heads (Cai et al. 2024, arXiv:2401.10774): K small heads on the target's last hidden state.

The target's LM head turns h_t, the final hidden state at position t, into token t+1. Head j (1..K)
turns the same h_t into a guess at token t+1+j: a residual SiLU block, then an LM head (the target's,
shared, or one of its own):

    head_j(h) = lm_head_j(h + SiLU(W_j h + b_j))          h [A, hidden] -> logits [A, vocab]

With W_j = 0 the head starts as the target's own LM head (Medusa's initialisation): it then guesses
token t+2 as if it were t+1, and training (train_drafter.py) teaches it the shift. No KV cache, no pass
per draft: all K drafts come from one gather of h and K small matmuls, so drafting costs almost
nothing; the price is that draft j does not see drafts 1..j-1, and acceptance falls with j faster than
an autoregressive drafter's (eagle.py).

At propose time a sequence of n tokens has computed positions 0..n-2 (its last token, sampled from
h_{n-2}, is computed by the verify pass itself), so the heads read h_{n-2} from the worker
(worker/hidden_states.py) and draft tokens n, n+1, ...: exactly the slots the verify checks.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import ReplicatedLinear
from .drafter_files import load_into, read_drafter
from .proposer import Proposer, sample_drafts


class ResBlock(nn.Module):
    """x + SiLU(W x + b): Medusa's block."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = ReplicatedLinear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))  # [A, hidden]


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_head: bool = False):
        super().__init__()
        self.config = {"method": "medusa", "hidden_size": hidden_size, "vocab_size": vocab_size,
                       "num_heads": num_heads, "num_layers": num_layers, "own_lm_head": own_lm_head}
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.lm_heads = (nn.ModuleList(ReplicatedLinear(hidden_size, vocab_size) for _ in range(num_heads))
                         if own_lm_head else None)

    def kv_cache_spec(self, dtype=None) -> list:
        return []  # no KV cache: the pool is sized for the target alone

    def reset_parameters(self, target=None) -> None:
        """Medusa's start: every block the identity (W = 0, b = 0); own LM heads copy the target's."""
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.zero_()
            if self.lm_heads is not None:
                for head in self.lm_heads:
                    head.weight.copy_(target.lm_head.weight)

    def forward(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """hidden [A, hidden] (the target's h_t) -> logits [K, A, vocab] fp32 for tokens t+2..t+K+1.
        lm_head: the target's compute_logits (used when the heads have none of their own)."""
        outs = []
        for j, block in enumerate(self.blocks):
            x = block(hidden)  # [A, hidden]
            outs.append(lm_head(x) if self.lm_heads is None else self.lm_heads[j](x).float())  # [A, vocab]
        return torch.stack(outs)  # [K, A, vocab]


def load_medusa(config, target) -> MedusaHeads:
    """The heads a speculative_config names: a saved folder (drafter_files.py) or a built MedusaHeads."""
    heads = config.model
    param = next(target.parameters())
    if not isinstance(heads, MedusaHeads):
        saved, tensors = read_drafter(heads, "medusa", target.config)
        with torch.device(param.device):
            heads = MedusaHeads(saved["hidden_size"], saved["vocab_size"], saved["num_heads"],
                                saved.get("num_layers", 1), saved.get("own_lm_head", False))
        load_into(heads, tensors, f"medusa heads {str(config.model)!r}")
    if heads.config["hidden_size"] != target.config.hidden_size or heads.config["vocab_size"] != target.config.vocab_size:
        raise ValueError(f"speculative_config model: Medusa heads of hidden {heads.config['hidden_size']} / vocab "
                         f"{heads.config['vocab_size']} do not fit a target of {target.config.hidden_size} / "
                         f"{target.config.vocab_size}")
    if config.num_speculative_tokens > heads.num_heads:
        raise ValueError(f"speculative_config num_speculative_tokens={config.num_speculative_tokens} is more than "
                         f"the {heads.num_heads} Medusa heads can draft")
    return heads.to(device=param.device, dtype=param.dtype).eval()


class MedusaProposer(Proposer):
    method = "medusa"

    def __init__(self, heads: MedusaHeads, target):
        self.heads, self.target = heads, target
        self.hidden_states = None  # the worker's HiddenStates (Worker.attach_proposer)

    @torch.inference_mode()
    def propose(self, seqs, num_spec, tables=None):
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_spec) if k > 0]
        found, h = self.hidden_states.last_rows([seqs[i].seq_id for i in active],
                                                [seqs[i].num_tokens - 2 for i in active])
        if h is None:
            return drafts, None
        active = [active[f] for f in found]  # those whose h_{n-2} the worker holds
        act = [seqs[i] for i in active]
        any_random = any(s.params.temperature > 0 for s in act)
        logits = self.heads(h, self.target.compute_logits)  # [K, A, vocab]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(num_spec[i] for i in active)):
            tokens, q = sample_drafts(logits[j], act, [j] * len(act), any_random)  # draft j+1 of each
            for row, i in enumerate(active):
                if j < num_spec[i]:
                    drafts[i].append(tokens[row])
                    if q is not None:
                        qs[i].append(q[row])
        probs = torch.stack([q for row in qs for q in row]) if any_random else None  # [D, V], drafts in order
        return drafts, probs
