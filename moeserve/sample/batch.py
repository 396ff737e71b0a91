"""A step's sampling parameters as one batch: built once per step from the scheduled requests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per logits row (a request has one row, plus one per MTP draft): its parameters as [R] values, and
    which rows take which path. greedy rows: argmax. exact rows (a request with its own seed): the
    per-request distribution and multinomial draw of before, bit for bit (filters.exact_filter,
    draw.exponential_noise), so a seed keeps its tokens. candidate rows (no seed of their own): one batched topk
    for the step and an inverse-CDF draw from the shared generator (filters.candidate_filter)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    temperature: torch.Tensor  # float32 [R]; 1 for greedy rows (never divided by)
    top_k: list[int]  # <= 0: off
    top_p: list[float]  # 1: off
    min_p: list[float]  # 0: off
    greedy_rows: list[int]
    exact_rows: list[int]
    candidate_rows: list[int]

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              num_rows: list[int] | None = None) -> "SamplingBatch":
        """params and generators per request; num_rows[i] rows of logits for request i (default 1)."""
        if num_rows is not None:
            params = [p for p, n in zip(params, num_rows) for _ in range(n)]
            generators = [g for g, n in zip(generators, num_rows) for _ in range(n)]
        greedy, exact, cand = [], [], []
        for i, (p, g) in enumerate(zip(params, generators)):
            (greedy if p.greedy else exact if g is not None else cand).append(i)
        return cls(params, list(generators),
                   torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
                   [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params],
                   greedy, exact, cand)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return len(self.greedy_rows) == len(self.params)

    def select(self, rows: list[int]) -> tuple[torch.Tensor, list[int], list[float], list[float]]:
        """(temperature, top_k, top_p, min_p) of these rows."""
        return (self.temperature.index_select(0, torch.tensor(rows, dtype=torch.long)),
                [self.top_k[i] for i in rows], [self.top_p[i] for i in rows], [self.min_p[i] for i in rows])
