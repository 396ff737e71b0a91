"""logits [R, V] -> one token per row for a SamplingBatch: greedy rows by one argmax, seeded rows by the exact
per-request path, the others by one batched candidate filter and inverse-CDF draw."""
from __future__ import annotations

import torch

from moeserve.sample.batch import SamplingBatch
from moeserve.sample.draw import MESSAGE, SamplingError, draw_candidates
from moeserve.sample.exact import sample_exact
from moeserve.sample.filters import Candidates, candidate_filter, exact_filter
from moeserve.sample.logprobs import TokenLogprobs, token_logprobs
from moeserve.sampling_params import SamplingParams


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> list[int | None]:
    """One token per row of logits [R, V] float32 (None: the row cannot be sampled: SamplingError's case).
    generator: the shared one, for rows without a seed of their own."""
    n = logits.shape[0]
    tokens: list[int | None] = [0] * n
    if batch.greedy_rows:
        if batch.all_greedy:
            return logits.argmax(dim=-1).tolist()
        sel = torch.tensor(batch.greedy_rows)
        for i, t in zip(batch.greedy_rows, logits.index_select(0, sel).argmax(dim=-1).tolist()):
            tokens[i] = t
    if batch.exact_rows:
        rows = batch.exact_rows
        for i, t in zip(rows, sample_exact(logits.index_select(0, torch.tensor(rows)), *batch.select(rows),
                                           [batch.generators[i] for i in rows])):
            tokens[i] = t
    if batch.candidate_rows:
        rows = batch.candidate_rows
        for group, cands in candidate_filter(logits.index_select(0, torch.tensor(rows)), *batch.select(rows)):
            for j, t in zip(group, draw_candidates(cands, generator)):
                tokens[rows[j]] = t
    return tokens


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distributions [R, V] the sampled rows draw from (greedy rows: one-hot at the argmax)."""
    n, V = logits.shape
    probs = torch.zeros(n, V, dtype=torch.float32)
    if batch.greedy_rows:
        sel = torch.tensor(batch.greedy_rows)
        probs[sel] = torch.zeros(len(sel), V).scatter_(1, logits.index_select(0, sel).argmax(-1, keepdim=True), 1.0)
    if batch.exact_rows:
        sel = torch.tensor(batch.exact_rows)
        probs[sel] = exact_filter(logits.index_select(0, sel), *batch.select(batch.exact_rows)).softmax(-1)
    if batch.candidate_rows:
        rows = batch.candidate_rows
        for group, c in candidate_filter(logits.index_select(0, torch.tensor(rows)), *batch.select(rows)):
            probs[torch.tensor([rows[j] for j in group])] = _dense(c, V)
    return probs


def _dense(c: Candidates, V: int) -> torch.Tensor:
    """Candidates as normalised [n, V] probabilities."""
    p = c.probs / c.probs.sum(-1, keepdim=True)
    return p if c.ids is None else torch.zeros(p.shape[0], V).scatter_(1, c.ids, p)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 raw_logits: torch.Tensor | None = None,
                 errors: dict[int, str] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [B, V] float32 -> one token per row, plus logprobs (of raw_logits, default logits).
        A row that cannot be sampled gets token 0 and its message in errors[row] (raises without errors)."""
        drawn = sample(logits, SamplingBatch.build(params, generators), self.generator)
        tokens = []
        for i, t in enumerate(drawn):
            if t is None:
                if errors is None:
                    raise SamplingError(MESSAGE)
                errors[i], t = MESSAGE, 0
            tokens.append(t)
        return tokens, self.logprobs(logits if raw_logits is None else raw_logits, params, tokens)

    @staticmethod
    def logprobs(logits: torch.Tensor, params: list[SamplingParams],
                 tokens: list[int]) -> list[TokenLogprobs | None]:
        """Logprobs of the raw model distribution (as vLLM and OpenAI report them)."""
        return token_logprobs(logits, tokens, [p.logprobs for p in params])
