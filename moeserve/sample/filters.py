"""Top-k, top-p and min-p for a batch of logits rows at once, on rows already divided by their temperatures
(sampler.SamplingBatch.scaled: the sampler applies the temperature).

Two paths, chosen per row by sampler.SamplingBatch:

- exact (requests with their own seed): the distribution is the one the per-request loop computed before
  (layers/sampler.apply_filters at commit 22b2f4d), bit for bit, so a seed keeps giving the same tokens:
  every op is the old one applied to a [n, V] batch (row-wise ops give each row the bits they gave it alone;
  the top-p sort is one batched sort of the top-k-masked rows, so ties at the top-p boundary fall as before).
- candidates (every other sampled row): top-k and top-p work on the row's best candidates only (one
  batched topk per step instead of a full-vocabulary sort per request), then min-p; the draw picks among
  the candidates (draw.draw_candidates). A top-p row whose nucleus its 256 best tokens do not hold uses the
  whole vocabulary (nucleus.py: a sort of its probabilities finds the nucleus's last one; tokens tied with
  it are kept), in one group with the temperature-only rows.
"""
from __future__ import annotations

import numpy as np
import torch

from moeserve.sample.nucleus import cut_nucleus

NEG_INF = float("-inf")
# rows with top_p and no top_k first try their best CANDIDATES tokens (one batched topk), unless their best
# probability shows those cannot reach top_p; the rows they do not cover use the whole vocabulary
CANDIDATES = 256


def exact_filter(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Filtered logits [n, V] (masked entries -inf) of the temperature-scaled rows x [n, V] (x is written):
    row i as the old per-request filter gave it for its parameters, bit for bit. top_k[i] <= 0 or >= V: off;
    top_p[i] >= 1: off; min_p[i] <= 0: off."""
    n, V = x.shape
    krows = [i for i in range(n) if 0 < top_k[i] < V]
    if krows:
        sel = torch.tensor(krows)
        rows = x.index_select(0, sel)
        ks = torch.tensor([top_k[i] for i in krows])
        kth = rows.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])  # the k-th largest value
        x[sel] = rows.masked_fill(rows < kth, NEG_INF)
    prows = [i for i in range(n) if top_p[i] < 1.0]
    if prows:
        sel = torch.tensor(prows)
        rows = x.index_select(0, sel)
        sorted_logits, order = rows.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        p = torch.tensor([top_p[i] for i in prows], dtype=torch.float32)[:, None]
        drop = probs.cumsum(-1) - probs >= p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False  # and always the best token (a top_p that rounds to 0 in float32 would drop all)
        x[sel] = rows.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)
    mrows = [i for i in range(n) if min_p[i] > 0.0]
    if mrows:
        sel = torch.tensor(mrows)
        rows = x.index_select(0, sel)
        probs = rows.softmax(-1)
        m = torch.tensor([min_p[i] for i in mrows], dtype=torch.float32)[:, None]
        x[sel] = rows.masked_fill(probs < m * probs.max(-1, keepdim=True).values, NEG_INF)
    return x


class Candidates:
    """A batch of rows reduced to their best candidates: probs [n, K] (0 where filtered out, rows need not
    sum to 1) of the token ids ids [n, K]; a row with K == V over the whole vocabulary."""

    def __init__(self, probs: torch.Tensor, ids: torch.Tensor | None) -> None:
        self.probs, self.ids = probs, ids  # ids None: column j is token j


def candidate_filter(x: torch.Tensor, top_k: list[int], top_p: list[float],
                     min_p: list[float]) -> list[tuple[list[int], Candidates]]:
    """The filtered distributions of the temperature-scaled rows x [n, V] as Candidates, grouped: [(row
    indices, Candidates)], each group from one batched op. top-k keeps exactly k tokens (the topk's, ties
    beyond it dropped); top-p the shortest prefix of the sorted candidates whose probability (under the
    top-k-filtered row) reaches top_p; min-p drops probabilities below min_p x the best one.
    Rows in the order of kinds() take no copies."""
    n, V = x.shape
    kind = kinds(top_k, top_p, V)
    groups: list[tuple[list[int], Candidates]] = []
    krows = [i for i in range(n) if kind[i] == 0]
    if krows:  # the candidates are the top-k: the row's mass outside them is filtered out anyway
        ks = torch.tensor([top_k[i] for i in krows])
        vals, ids = _topk(take_rows(x, krows), int(ks.max()))
        vals = vals.masked_fill(torch.arange(vals.shape[1])[None, :] >= ks[:, None], NEG_INF)
        probs = vals.softmax(-1)
        groups.append((krows, _finish(probs, ids, [top_p[i] for i in krows], [min_p[i] for i in krows])))
    prows = [i for i in range(n) if kind[i] == 1]
    rest = [i for i in range(n) if kind[i] == 2]  # temperature (and min-p) only
    if not prows and not rest:
        return groups
    # the rows over the whole vocabulary (the top-p rows whose best candidates do not hold the nucleus, and
    # rest): one softmax, and one group (one _finish, one draw)
    np_ = len(prows)
    allp = take_rows(x, prows + rest).softmax(-1)
    left = list(range(np_))
    if prows:
        probs = allp[:np_]
        p = torch.tensor([top_p[i] for i in prows], dtype=torch.float32)
        if CANDIDATES < V:
            # the best CANDIDATES tokens, for rows where they can hold top_p: their mass is at most CANDIDATES x
            # the best probability, and at most sqrt(CANDIDATES x sum of squares) (Cauchy-Schwarz, a second pass:
            # only for the rows the first leaves open), which rules out flat rows without a topk that would fail
            tried = [j for j, h in enumerate((CANDIDATES * probs.amax(-1) < p).tolist()) if not h]
            if tried:
                sq = (CANDIDATES * take_rows(probs, tried).square().sum(-1)).sqrt_()
                tried = [j for j, h in zip(tried, (sq < p[tried]).tolist()) if not h]
            if tried:
                sel = torch.tensor(tried)
                vals, ids = _topk(probs.index_select(0, sel), CANDIDATES)
                ok = (vals.sum(-1) >= p.index_select(0, sel)).tolist()  # the nucleus lies inside them
                done = [k for k, c in enumerate(ok) if c]
                if done:
                    keep = torch.tensor(done)
                    held = [tried[k] for k in done]
                    groups.append(([prows[j] for j in held], _finish(vals[keep], ids[keep],
                                                                      [top_p[prows[j]] for j in held],
                                                                      [min_p[prows[j]] for j in held])))
                    left = sorted(set(left) - set(held))
        if left:  # flat distributions: the nucleus over the whole vocabulary
            if len(left) == np_:
                cut_nucleus(probs, p[:, None])
            else:
                sel = torch.tensor(left)
                sub = probs.index_select(0, sel)
                cut_nucleus(sub, p.index_select(0, sel)[:, None])
                allp = torch.cat([sub, allp[np_:]])
        else:
            allp = allp[np_:]
    full = [prows[j] for j in left] + rest
    if full:
        groups.append((full, _finish(allp, None, [1.0] * len(full), [min_p[i] for i in full])))
    return groups


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=-1) of float32 rows [n, V] (values descending, their ids) by numpy's vectorised selection
    and a sort of the k: ATen's topk first copies every row into (value, index) pairs, ~1.5x the time here.
    Which of several values equal to the k-th largest are kept may differ from topk's (both keep exactly k)."""
    V = x.shape[-1]
    if k >= V or x.dtype != torch.float32:
        return x.topk(k, dim=-1)
    xn = x.contiguous().numpy()
    ids = np.argpartition(xn, V - k, axis=-1)[:, V - k:]  # the k largest (NaN as the largest), unordered
    vals = np.take_along_axis(xn, ids, axis=-1)
    order = np.argsort(vals, axis=-1, kind="stable")[:, ::-1]  # descending
    return (torch.from_numpy(np.take_along_axis(vals, order, axis=-1)),
            torch.from_numpy(np.take_along_axis(ids, order, axis=-1)))


def group_key(top_k: int, top_p: float, min_p: float, V: float) -> tuple[int, bool]:
    """Where a candidate row goes in kinds() order, with the rows that take a min_p together (the top-p ones
    last, the others first: one group after candidate_filter merges them), for _finish's min-p on a view."""
    kind = kinds([top_k], [top_p], V)[0]
    return kind, (min_p > 0.0) == (kind == 1)


def kinds(top_k: list[int], top_p: list[float], V: float) -> list[int]:
    """candidate_filter's group of each row: 0 top-k, 1 top-p (no top-k), 2 neither."""
    return [0 if 0 < k < V else 1 if p < 1.0 else 2 for k, p in zip(top_k, top_p)]


def consecutive(idx: list[int]) -> bool:
    return idx == list(range(idx[0], idx[0] + len(idx)))


def take_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x's rows idx: a view when they are consecutive (no copy), else a copy."""
    if consecutive(idx):
        return x[idx[0]:idx[0] + len(idx)]
    return x.index_select(0, torch.tensor(idx))


def _finish(probs: torch.Tensor, ids: torch.Tensor | None, top_p: list[float],
            min_p: list[float]) -> Candidates:
    """top-p (probs sorted descending when any top_p < 1) and min-p on candidate probabilities."""
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=torch.float32)[:, None]
        drop = probs.cumsum(-1) - probs >= p
        drop[:, 0] = False
        probs = probs * ~drop
    mrows = [i for i, m in enumerate(min_p) if m > 0.0]
    if mrows:  # only the rows with a min_p (a whole-vocabulary pass costs ~0.1 ms a row), in place (probs is
        # ours): consecutive rows (sampler.SamplingBatch.candidate_ordered) as a view, others copied and back
        rows = take_rows(probs, mrows)
        m = torch.tensor([min_p[i] for i in mrows], dtype=torch.float32)
        # keep p >= min_p x max: zero p <= the float32 below that, a vectorised threshold_ per row (a bool mask
        # and masked_fill cost ~10x that here)
        below = torch.nextafter(m * rows.amax(-1), torch.tensor(NEG_INF)).tolist()
        for j, t in enumerate(below):
            torch.nn.functional.threshold_(rows[j], t, 0.0)
        if not consecutive(mrows):
            probs.index_copy_(0, torch.tensor(mrows), rows)
    return Candidates(probs, ids)

