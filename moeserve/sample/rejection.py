"""Verification of draft tokens against the main model: greedy prefix match or rejection sampling.

For each request the main model scored d drafts in one pass, giving d + 1 rows of logits: row j is the
distribution of the token after [context + drafts[:j]]. We keep the longest acceptable prefix of the drafts
and add one token from the first row that was not accepted (or the bonus row d), so a step emits 1..d+1
tokens.
- Greedy: a draft is accepted iff it is the argmax; the output equals plain greedy decoding token for token.
- Sampling (temperature > 0): draft x ~ q is accepted with probability min(1, p(x) / q(x)); on rejection the
  token is drawn from norm(max(0, p - q)) (Leviathan et al. 2023, Chen et al. 2023). Every emitted token is
  then distributed exactly as the main model's p (after temperature / top-k / top-p / min-p). MTP drafts are
  the draft layer's argmax, i.e. q is one-hot (draft_probs None): accept with p(x), else draw from p with x
  removed.
"""
from __future__ import annotations

import torch

from moeserve.sample.draw import MESSAGE, SamplingError, argmax, bad_rows, draw
from moeserve.sample.filters import exact_filter
from moeserve.sample.sampler import SamplingBatch, filtered_probs, scale
from moeserve.sampling_params import SamplingParams


def accept_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """target_ids [d + 1] argmax of each row -> accepted drafts + the correcting/bonus token."""
    n = 0
    while n < len(drafts) and drafts[n] == target_ids[n]:
        n += 1
    return target_ids[: n + 1]


def rejection_sample(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                     generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits [d + 1, V] float32; draft_probs [d, V] (None: one-hot drafts) -> 1..d+1 tokens."""
    n = logits.shape[0]
    x = scale(logits, torch.full((n,), params.temperature, dtype=torch.float32))
    probs = exact_filter(x, [params.top_k] * n, [params.top_p] * n, [params.min_p] * n).softmax(-1)  # [d + 1, V]
    return verify(probs, drafts, generator, draft_probs)


def verify(probs: torch.Tensor, drafts: list[int], generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs [d + 1, V]: the filtered target distributions of one request's rows -> 1..d+1 tokens."""
    accept_u = torch.rand(len(drafts), generator=generator)
    out: list[int] = []
    for j, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
        if accept_u[j] * q_x < probs[j, x]:  # probability min(1, p(x) / q(x))
            out.append(x)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[x] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: rejection has probability 0 (numerical edge)
            residual = probs[j]
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out


class RejectionSampler:
    """Verifies every request of a step; requests without drafts are sampled as usual (d = 0)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(self, logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                 generators: list[torch.Generator | None], errors: dict[int, str] | None = None) -> list[list[int]]:
        """logits [sum(d_i + 1), V] float32, rows of request i contiguous -> emitted tokens per request.
        A request whose rows cannot be sampled emits [0] and gets its message in errors[i] (raises without)."""
        assert logits.shape[0] == sum(len(d) + 1 for d in drafts), "one row per draft plus one per request"
        num_rows = [len(d) + 1 for d in drafts]
        batch = SamplingBatch.build(params, generators, num_rows)
        if batch.all_greedy:
            target_ids, probs, bad = argmax(logits).tolist(), None, None
        else:  # every sampled row's filtered distribution in one batched pass
            target_ids = argmax(logits).tolist()
            probs = filtered_probs(logits, batch)
            bad = bad_rows(probs)
        out, row = [], 0
        for d, p, g, n in zip(drafts, params, generators, num_rows):
            if p.greedy:
                out.append(accept_greedy(target_ids[row: row + n], d))
            else:
                try:
                    if any(bad[row: row + n]):  # as rejection_sample: filtered rows it cannot draw from
                        raise SamplingError(MESSAGE)
                    out.append(verify(probs[row: row + n], d, g or self.generator))
                except SamplingError as e:
                    if errors is None:
                        raise
                    errors[len(out)] = str(e)
                    out.append([0])
            row += n
        return out
