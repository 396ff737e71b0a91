"""logits [R, V] -> one token per row: the step's parameters as one SamplingBatch, the temperature divide, and
greedy rows by one argmax, seeded rows by the exact per-request path, the others by one batched candidate
filter and inverse-CDF draw. The filters (filters.py, exact.py) take the rows already divided by their
temperatures: temperature is applied here, once, where the batch is built."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.sample.draw import MESSAGE, SamplingError, argmax, draw_candidates
from moeserve.sample.exact import sample_exact
from moeserve.sample.filters import (Candidates, candidate_filter, consecutive, exact_filter, group_key,
                                      take_rows)
from moeserve.sample.logprobs import TokenLogprobs, log_softmax_rows, token_logprobs
from moeserve.sampling_params import SamplingParams


def scale(logits: torch.Tensor, temperature: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """logits [n, V] / temperature [n] (inplace: into logits, a copy of the caller's); masked (-inf) entries stay
    masked (-inf / a temperature that overflows float32 would be NaN; a finite one leaves +-inf as it is, so
    then no where is needed)."""
    if bool(torch.isfinite(temperature).all()):
        return logits.div_(temperature[:, None]) if inplace else logits / temperature[:, None]
    return torch.where(torch.isinf(logits), logits, logits / temperature[:, None])


@dataclass
class SamplingBatch:
    """A step's sampling parameters per logits row (a request has one row, plus one per MTP draft), built once
    per step from the scheduled requests: its parameters as [R] values, and which rows take which path.
    greedy rows: argmax. exact rows (a request with its own seed): the per-request distribution and
    multinomial draw of before, bit for bit (filters.exact_filter, draw.exponential_noise), so a seed keeps its
    tokens. candidate rows (no seed of their own): one batched topk for the step and an inverse-CDF draw from
    the shared generator (filters.candidate_filter)."""

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

    def scaled(self, logits: torch.Tensor, rows: list[int], writable: bool = False) -> torch.Tensor:
        """These rows of logits [R, V], divided by their temperatures: what the filters take. writable: logits
        may be overwritten, so consecutive rows are divided where they are (no copy of them)."""
        if writable and consecutive(rows):
            return scale(take_rows(logits, rows), self.temperature[rows[0]:rows[0] + len(rows)], inplace=True)
        sel = torch.tensor(rows, dtype=torch.long)
        return scale(logits.index_select(0, sel), self.temperature.index_select(0, sel), inplace=True)

    def candidate_ordered(self, vocab: int) -> list[int]:
        """candidate_rows grouped as filters.candidate_filter groups them: each group's scaled rows are then
        a slice of one copy, not a second copy."""
        return sorted(self.candidate_rows,
                      key=lambda i: group_key(self.top_k[i], self.top_p[i], self.min_p[i], vocab))

    def select(self, rows: list[int]) -> tuple[list[int], list[float], list[float]]:
        """(top_k, top_p, min_p) of these rows."""
        return [self.top_k[i] for i in rows], [self.top_p[i] for i in rows], [self.min_p[i] for i in rows]


def path_order(params: list[SamplingParams]) -> list[int]:
    """The order of a step's requests (one logits row each) in which each of sample()'s paths takes a slice of
    the logits, not a copy of its rows: greedy, seeded (the exact path), then the candidate rows as
    SamplingBatch.candidate_ordered groups them. Stable: the order within a path is kept."""
    def key(i: int) -> tuple:
        p = params[i]
        if p.greedy:
            return (0,)
        if p.seed is not None:  # StepSampler gives exactly these a generator: SamplingBatch's exact rows
            return (1,)
        return (2, *group_key(p.top_k, p.top_p, p.min_p, math.inf))  # any vocabulary above top_k
    return sorted(range(len(params)), key=key)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator,
           writable: bool = False) -> list[int | None]:
    """One token per row of logits [R, V] float32 (None: the row cannot be sampled: SamplingError's case).
    generator: the shared one, for rows without a seed of their own. writable: logits may be overwritten (the
    rows of a path in path_order are then scaled where they are)."""
    n = logits.shape[0]
    tokens: list[int | None] = [0] * n
    if batch.greedy_rows:
        if batch.all_greedy:
            return argmax(logits).tolist()
        for i, t in zip(batch.greedy_rows, argmax(take_rows(logits, batch.greedy_rows)).tolist()):
            tokens[i] = t
    if batch.exact_rows:
        rows = batch.exact_rows
        for i, t in zip(rows, sample_exact(batch.scaled(logits, rows, writable), *batch.select(rows),
                                           [batch.generators[i] for i in rows])):
            tokens[i] = t
    if batch.candidate_rows:
        rows = batch.candidate_ordered(logits.shape[-1])
        for group, cands in candidate_filter(batch.scaled(logits, rows, writable), *batch.select(rows)):
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
        rows = batch.exact_rows
        probs[torch.tensor(rows)] = exact_filter(batch.scaled(logits, rows), *batch.select(rows)).softmax(-1)
    if batch.candidate_rows:
        rows = batch.candidate_ordered(logits.shape[-1])
        for group, c in candidate_filter(batch.scaled(logits, rows), *batch.select(rows)):
            probs[torch.tensor([rows[j] for j in group])] = _dense(c, V)
    return probs


def apply_filters(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled, filtered logits [V] for one request's SamplingParams p (masked entries -inf)."""
    x = scale(logits[None], torch.tensor([p.temperature], dtype=torch.float32))
    return exact_filter(x, [p.top_k], [p.top_p], [p.min_p])[0]


def processed_logits(logits: torch.Tensor, params: list) -> torch.Tensor:
    """--logprobs-mode processed_*: the logits each row [R, V] draws from, as a copy (logits are the rows after
    logit_bias, penalties, token masks and grammar; params one SamplingParams per row). Greedy rows as they are
    (the argmax is taken of them, as vLLM's all-greedy batch reports them); the others divided by their
    temperature, then top-k, top-p and min-p, masked entries -inf, as exact_filter gives them to the draw."""
    out = logits.clone()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sel = torch.tensor(rows)
        ps = [params[i] for i in rows]
        x = scale(out.index_select(0, sel), torch.tensor([p.temperature for p in ps], dtype=torch.float32),
                  inplace=True)
        out[sel] = exact_filter(x, [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps])
    return out


def _dense(c: Candidates, V: int) -> torch.Tensor:
    """Candidates as normalised [n, V] probabilities."""
    p = c.probs / c.probs.sum(-1, keepdim=True)
    return p if c.ids is None else torch.zeros(p.shape[0], V).scatter_(1, c.ids, p)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 raw_logits: torch.Tensor | None = None, errors: dict[int, str] | None = None,
                 writable: bool = False) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [B, V] float32 -> one token per row, plus logprobs (of raw_logits, default logits).
        A row that cannot be sampled gets token 0 and its message in errors[row] (raises without errors).
        writable: logits may be overwritten (faster with rows in path_order); the logprobs are taken first."""
        num_top = [p.logprobs for p in params]
        as_logits = [p.logprobs_as_logits for p in params]
        raw = logits if raw_logits is None else raw_logits
        # the logprobs rows' log_softmax before sample() may scale those rows in place
        prepared = log_softmax_rows(raw, num_top, as_logits) if writable and raw is logits else None
        drawn = sample(logits, SamplingBatch.build(params, generators), self.generator, writable)
        tokens = []
        for i, t in enumerate(drawn):
            if t is None:
                if errors is None:
                    raise SamplingError(MESSAGE)
                errors[i], t = MESSAGE, 0
            tokens.append(t)
        # logprobs of raw_logits: the raw model distribution (as vLLM and OpenAI report them) unless the caller
        # gave the processed rows (StepSampler, --logprobs-mode processed_*)
        return tokens, token_logprobs(raw, tokens, num_top, prepared, as_logits)
