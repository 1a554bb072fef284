"""Adaptive speculation: k chosen per step, from the batch size and the acceptance measured so far.

A verify step of k drafts per sequence is nearly free while the forward pass is memory-bound (the
weights are read once, whatever the tokens), and costs k + 1 times a plain step once the batch has
made it compute-bound. With B sequences and S the tokens at which a pass saturates the GPU (its
"saturation_tokens"), model the verify step's cost, in plain steps, as

    r(B, k) = max(1, B (k + 1) / S) / max(1, B / S)

so r = 1 for a small batch and r = k + 1 once B >= S; drafting costs c per draft (draft_cost, in plain
steps). With alpha the running acceptance rate (each verify moves it a tenth of the way to its own
rate), acceptance.py's model gives each k its expected speedup E(alpha, k) / (r(B, k) + c k), and the
step uses the best k in 0..num_speculative_tokens, the smallest on a tie. At B >= S no k beats 1, so a
large batch drafts nothing, whatever the drafter: speculation never costs throughput there. A bad
drafter's alpha falls until no k pays at any batch size, and it stops drafting too.

(No draft, no measurement: once alpha has fallen so far that nothing drafts, it stays. The per-sequence
back-off, min_acceptance_rate, is the tool that probes again.)
"""

from __future__ import annotations

from .acceptance import optimal_k

# per method, a draft token's cost in plain decode steps when nothing has been measured (the bench
# measures t_draft: set draft_cost from it)
DRAFT_COST = {"ngram": 0.01, "medusa": 0.03, "eagle": 0.1, "layer_skip": 0.3, "draft_model": 0.3}


class AdaptiveK:
    def __init__(self, k_max: int, draft_cost: float, saturation_tokens: int, prior: float = 0.6,
                 decay: float = 0.9):
        self.k_max, self.c, self.S = k_max, draft_cost, saturation_tokens
        self.alpha, self.decay = prior, decay
        self._best: dict[tuple[int, float], int] = {}

    @classmethod
    def from_config(cls, config) -> AdaptiveK:
        cost = config.draft_cost if config.draft_cost is not None else DRAFT_COST[config.method]
        return cls(config.num_speculative_tokens, cost, config.saturation_tokens)

    def observe(self, drafted: int, accepted: int) -> None:
        """One sequence's verify: drafted guesses, the first `accepted` of them kept."""
        if drafted:
            self.alpha = self.decay * self.alpha + (1 - self.decay) * accepted / drafted

    def verify_cost(self, batch_size: int, k: int) -> float:
        return max(1.0, batch_size * (k + 1) / self.S) / max(1.0, batch_size / self.S)

    def k(self, batch_size: int) -> int:
        """The draft tokens a step of batch_size running sequences should carry (0: none)."""
        key = (batch_size, round(self.alpha, 3))
        best = self._best.get(key)
        if best is None:
            best = self._best[key] = optimal_k(key[1], self.c, self.k_max,
                                               lambda k: self.verify_cost(batch_size, k))
        return best
