"""`SpecDecodingStats` (vLLM's name and fields): what speculation proposed and what the target accepted — one
for each step (StepMetrics.spec_decoding), each request (RequestMetrics.spec_decoding) and the runner's total
(memory_stats()["spec_decoding"]); the figures a chart, a Prometheus counter or a cost model reads.

Definitions (vLLM's): a draft is one sequence's proposal verified in one step (`num_drafts`), of
`num_draft_tokens` tokens in all, `num_accepted_tokens` of them accepted; `num_accepted_tokens_per_pos[j]` counts
the drafts whose token j was accepted (a prefix is accepted, so the counts never increase with j). Acceptance
rate = accepted / draft tokens; by position j = accepted at j / drafts that reached j; mean acceptance length =
1 + accepted / drafts, the tokens a verified sequence gains per step (the bonus or replacement token included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # drafts that reached position j

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One draft of `num_draft_tokens` tokens, its first `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        for j in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[j] += 1
            self.num_accepted_tokens_per_pos[j] += j < num_accepted

    def add(self, other: SpecDecodingStats) -> None:
        """Fold `other` (a step's) into these (a total's)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.num_draft_tokens_per_pos, other.num_draft_tokens_per_pos),
                             (self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos)):
            mine += [0] * (len(theirs) - len(mine))
            for j, n in enumerate(theirs):
                mine[j] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / n for a, n in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate, "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
                "mean_acceptance_length": self.mean_acceptance_length}
