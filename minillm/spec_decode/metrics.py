"""Speculative decoding's counters, defined once (vLLM's definitions, spec_decode/metrics.py there):

    acceptance rate          accepted draft tokens / draft tokens
    mean acceptance length   1 + accepted / verify steps with drafts: tokens emitted per such step,
                             the bonus or replacement token included
    per-position acceptance  of the drafts at position j (0 = the first guess), the share accepted

One object per sequence (summed per request in RequestOutput.spec) and one in EngineStats.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: drafts proposed at position j
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: of those, accepted

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One sequence's verify: num_draft guesses, the first num_accepted of them accepted."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for counts, upto in ((self.drafted_per_position, num_draft), (self.accepted_per_position, num_accepted)):
            counts.extend([0] * (num_draft - len(counts)))
            for j in range(upto):
                counts[j] += 1

    def merge(self, other: SpecDecodeMetrics, sign: int = 1) -> SpecDecodeMetrics:
        """self + other (sign=-1: self - other, the counts since a snapshot)."""
        out = SpecDecodeMetrics(*(getattr(self, n) + sign * getattr(other, n)
                                  for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")))
        for name in ("drafted_per_position", "accepted_per_position"):
            a, b = getattr(self, name), getattr(other, name)
            width = max(len(a), len(b))
            setattr(out, name, [x + sign * y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)))])
        return out

    def snapshot(self) -> SpecDecodeMetrics:
        return self.merge(SpecDecodeMetrics())

    def minus(self, before: SpecDecodeMetrics) -> SpecDecodeMetrics:
        return self.merge(before, -1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_per_position": self.acceptance_per_position}

    def summary(self) -> str:
        """One line for the CLI and the bench."""
        per = " ".join(f"{r:.2f}" for r in self.acceptance_per_position)
        return (f"spec decode: {self.num_accepted_tokens}/{self.num_draft_tokens} drafts accepted "
                f"({self.acceptance_rate:.1%}), mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"per position [{per}]")
