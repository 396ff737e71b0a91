"""Speculative-decoding counters (cumulative since start, Prometheus-counter style)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0  # verification events: request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] drafts accepted at position j
    drafts_per_position: list[int] = field(default_factory=list)  # [k] drafts verified at position j

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_spec_tokens
        self.drafts_per_position = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request verified num_draft_tokens drafts and kept the first num_accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_draft_tokens):
            self.drafts_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (1 + accepted drafts), vLLM's 'mean acceptance length'."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
