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
  whole vocabulary (a radix select over the row's float bits finds the nucleus's last value; tokens tied
  with it are kept).
"""
from __future__ import annotations

import torch

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
    top-k-filtered row) reaches top_p; min-p drops probabilities below min_p x the best one."""
    n, V = x.shape
    groups: list[tuple[list[int], Candidates]] = []
    krows = [i for i in range(n) if 0 < top_k[i] < V]
    if krows:  # the candidates are the top-k: the row's mass outside them is filtered out anyway
        ks = torch.tensor([top_k[i] for i in krows])
        vals, ids = x.index_select(0, torch.tensor(krows)).topk(int(ks.max()), dim=-1)
        vals = vals.masked_fill(torch.arange(vals.shape[1])[None, :] >= ks[:, None], NEG_INF)
        probs = vals.softmax(-1)
        groups.append((krows, _finish(probs, ids, [top_p[i] for i in krows], [min_p[i] for i in krows])))
    prows = [i for i in range(n) if not 0 < top_k[i] < V and top_p[i] < 1.0]
    if prows:
        xs = x.index_select(0, torch.tensor(prows))
        probs = xs.softmax(-1)
        p = torch.tensor([top_p[i] for i in prows], dtype=torch.float32)
        left = list(range(len(prows)))
        if CANDIDATES < V:
            # the best CANDIDATES tokens, for rows where they can hold top_p: their mass is at most CANDIDATES x
            # the best probability, and at most sqrt(CANDIDATES x sum of squares) (Cauchy-Schwarz), which rules
            # out flat rows without a topk that would only fail
            bound = torch.minimum(CANDIDATES * probs.amax(-1), (CANDIDATES * probs.square().sum(-1)).sqrt_())
            tried = [j for j, h in enumerate((bound < p).tolist()) if not h]
            if tried:
                sel = torch.tensor(tried)
                vals, ids = probs.index_select(0, sel).topk(CANDIDATES, dim=-1)
                ok = (vals.sum(-1) >= p.index_select(0, sel)).tolist()  # the nucleus lies inside them
                done = [k for k, c in enumerate(ok) if c]
                if done:
                    keep = torch.tensor(done)
                    rows = [tried[k] for k in done]
                    groups.append(([prows[j] for j in rows], _finish(vals[keep], ids[keep],
                                                                      [top_p[prows[j]] for j in rows],
                                                                      [min_p[prows[j]] for j in rows])))
                    left = sorted(set(left) - set(rows))
        if left:  # flat distributions: the whole vocabulary
            rows = [prows[j] for j in left]
            if len(left) < len(prows):
                sel = torch.tensor(left)
                xs, probs, p = xs.index_select(0, sel), probs.index_select(0, sel), p.index_select(0, sel)
            # the scaled logits' order and ties are the probabilities' (the old filter sorted them too)
            keep = _nucleus(xs, probs, p[:, None])
            groups.append((rows, _finish(probs.mul_(keep), None, [1.0] * len(rows), [min_p[i] for i in rows])))
    rest = [i for i in range(n) if not 0 < top_k[i] < V and not top_p[i] < 1.0]
    if rest:  # temperature (and min-p) only: the whole vocabulary, unsorted
        probs = x.index_select(0, torch.tensor(rest)).softmax(-1)
        groups.append((rest, _finish(probs, None, [1.0] * len(rest), [min_p[i] for i in rest])))
    return groups


# _nucleus's digits of a row's int32 keys, most significant first: (shift, bins); the first level counts every
# token, the later ones only the tokens left in the chosen digit (a few hundred on a flat row)
LEVELS = ((20, 4096), (8, 4096), (0, 256))


def _nucleus(raw: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [m, V]: the top-p nucleus of each row (the shortest prefix of the sorted probabilities reaching
    top_p [m, 1], and the tokens tied with its last one). raw [m, V]: the logits (their order is the
    probabilities' order), probs their filtered softmax.

    No sort: the row's float32 bits as order-preserving int32 keys, and the nucleus's last key found digit by
    digit (a radix select): the probability mass per value of the key's top 12 bits (one bincount for the
    rows), from the top until it reaches top_p x the row's mass, then the same over the next 12 and last 8
    bits among the tokens of the chosen digit only. About 3 passes over the rows plus a few small ops;
    bfloat16-valued or not alike (a float sort of the row, or a radix sort of its bfloat16 keys, before)."""
    m, V = raw.shape
    bits = raw.contiguous().view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # sign-magnitude -> two's complement: int32 in the floats' order
    target = top_p[:, 0].to(torch.float64)
    above = torch.zeros(m, dtype=torch.float64)  # per row: the mass of the keys above the digits chosen so far
    boundary = torch.zeros(m, dtype=torch.int64)
    k, w, r = key.view(-1), probs.contiguous().view(-1), torch.empty(0, dtype=torch.long)
    for level, (shift, bins) in enumerate(LEVELS):
        if level == 0:
            d = (k >> shift) + bins // 2  # the signed top digit, offset to 0..bins-1
            flat = (d.view(m, V) + torch.arange(0, m * bins, bins, dtype=torch.int32)[:, None]).view(-1)
        else:
            d = (k >> shift) & (bins - 1)
            flat = d + r * bins
        hist = torch.bincount(flat, weights=w, minlength=m * bins).view(m, bins).to(torch.float64).flip(-1)
        if level == 0:
            target = target * hist.sum(-1)
        c = hist.cumsum(-1).add_(above[:, None])
        j = (c < target[:, None]).sum(-1)  # the first digit (from the top) where the mass reaches top_p
        nz = (hist > 0).to(torch.uint8)  # never an empty digit (a top_p that rounds to 0, rounding at the end)
        j = torch.minimum(torch.maximum(j, nz.argmax(-1)), (bins - 1) - nz.flip(-1).argmax(-1))
        above = (c.gather(1, j[:, None]) - hist.gather(1, j[:, None]))[:, 0]
        digit = (bins - 1) - j
        if level == 0:
            boundary = (digit - bins // 2) << shift
            sel = (d.view(m, V) == digit.to(torch.int32)[:, None]).view(-1).nonzero()[:, 0]
            k, w, r = k.index_select(0, sel), w.index_select(0, sel), sel // V
        else:
            boundary |= digit << shift
            if shift:
                sel = (d == digit.to(torch.int32).index_select(0, r)).nonzero()[:, 0]
                k, w, r = k.index_select(0, sel), w.index_select(0, sel), r.index_select(0, sel)
    return key >= boundary.to(torch.int32)[:, None]


def _finish(probs: torch.Tensor, ids: torch.Tensor | None, top_p: list[float],
            min_p: list[float]) -> Candidates:
    """top-p (probs sorted descending when any top_p < 1) and min-p on candidate probabilities."""
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=torch.float32)[:, None]
        drop = probs.cumsum(-1) - probs >= p
        drop[:, 0] = False
        probs = probs * ~drop
    mrows = [i for i, m in enumerate(min_p) if m > 0.0]
    if len(mrows) == len(min_p):
        m = torch.tensor(min_p, dtype=torch.float32)[:, None]
        probs = probs * (probs >= m * probs.amax(-1, keepdim=True))
    elif mrows:  # only the rows with a min_p: a whole-vocabulary pass costs ~0.1 ms a row
        sel = torch.tensor(mrows)
        rows = probs.index_select(0, sel)
        m = torch.tensor([min_p[i] for i in mrows], dtype=torch.float32)[:, None]
        probs = probs.index_copy(0, sel, rows * (rows >= m * rows.amax(-1, keepdim=True)))
    return Candidates(probs, ids)

