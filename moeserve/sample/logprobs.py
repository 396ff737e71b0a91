"""Logprobs of sampled tokens and of prompt tokens, batched over the step's rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.sample.draw import argmax
from moeserve.sample.filters import take_rows


# ATen's CPU topk takes a partial sort when k x 64 <= the row's length (else nth_element, whose order of equal
# values is not the first-first one max gives)
TOPK_PARTIAL_SORT = 64


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def log_softmax_rows(logits: torch.Tensor, num_top: list[int | None],
                     as_logits: list[bool] | None = None) -> tuple[list[int], torch.Tensor | None]:
    """The rows that want logprobs (num_top not None), grouped by count, and their log_softmax [n, V] (rows
    with as_logits[i], --logprobs-mode *_logits: a copy of the values themselves): what token_logprobs reads
    of logits, to take before logits are written (sampler.Sampler, writable)."""
    # the rows grouped by count: each count's topk on a slice of logp, not a copy of its rows
    rows = sorted((i for i, n in enumerate(num_top) if n is not None), key=lambda i: num_top[i])
    if not rows:
        return rows, None
    sel = take_rows(logits, rows)  # a slice where the rows are consecutive
    keep = [j for j, i in enumerate(rows) if as_logits is not None and as_logits[i]]
    if len(keep) == len(rows):
        return rows, sel.clone()
    logp = sel.log_softmax(dim=-1)
    if keep:
        idx = torch.tensor(keep)
        logp[idx] = sel.index_select(0, idx)
    return rows, logp


def token_logprobs(logits: torch.Tensor | None, tokens: list[int], num_top: list[int | None],
                   prepared: tuple[list[int], torch.Tensor | None] | None = None,
                   as_logits: list[bool] | None = None) -> list[TokenLogprobs | None]:
    """logits [R, V] (by default the raw model distribution, as vLLM and OpenAI report it; processed_logits
    gives the processed ones), the token of each row and how many top entries it wants (None: no logprobs for
    that row). One log_softmax for the rows that want logprobs (prepared: log_softmax_rows(logits, num_top)
    taken earlier; as_logits[i]: row i reports the values, not their log_softmax) and one topk per count."""
    rows, logp = prepared if prepared is not None else log_softmax_rows(logits, num_top, as_logits)
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows])[:, None])[:, 0].tolist()
    tops: dict[int, list] = {j: [] for j in range(len(rows))}
    by_n: dict[int, list[int]] = {}
    for j, i in enumerate(rows):
        if num_top[i]:
            by_n.setdefault(num_top[i], []).append(j)
    for n, js in by_n.items():
        rows_n = logp[js[0]:js[-1] + 1]
        if n == 1 and logp.shape[-1] >= TOPK_PARTIAL_SORT:
            # the first maximum, as topk(1) picks it (its partial sort keeps the first of equal values), without
            # topk's copy of every row into (value, index) pairs
            ids = argmax(rows_n)[:, None]
            top_ids, top_vals = ids.tolist(), rows_n.gather(1, ids).tolist()
        else:
            top = rows_n.topk(min(n, logp.shape[-1]))
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        for j, ids, vals in zip(js, top_ids, top_vals):
            tops[j] = list(zip(ids, vals))
    for j, i in enumerate(rows):
        out[i] = TokenLogprobs(tokens[i], chosen[j], tops[j])
    return out
