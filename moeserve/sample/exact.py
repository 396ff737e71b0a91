"""Seeded rows: the per-request loop's tokens and generator streams, bit for bit, without its full sort where
the sort's order cannot change the token.

The old filter (filters.exact_filter) finds the top-p nucleus by torch.sort, an unstable sort: among tokens
tied with the nucleus's last value, which ones it keeps is the sort's permutation, so matching it needs that
very sort (about 2 ms a row at V = 32000). But only those ties depend on it:

- the sorted *values* are the same whatever sort gives them, so the cumulative probabilities, the kept count
  k and the boundary value v (the k-th largest) are the old ones bit for bit. Here they come from a
  values-only sort of the scaled rows (numpy's vectorised sort, ~4x faster than an argsort and a gather);
- when no token beyond the first k ties with v, the kept set is exactly {x >= v}: the filtered row, its
  softmax and the draw are the old ones bit for bit;
- when some do (the old sort kept some of the tokens equal to v, which ones unknown), the draw
  argmax(p / q) is settled anyway if its winner over {x >= v} (all ties kept) is a token above v that beats
  the runner-up by a margin: the kept set lies between {x > v} and {x >= v} and holds that winner, and the
  softmax's normaliser, the only other thing the unknown set changes, scales every p alike (the margin
  covers the roundings). Otherwise (the winner is one of the ties, or a near tie) the row takes the old
  filter with its sort, drawing from the same noise.

Rows with min_p (a threshold on probabilities, whose normaliser the unknown set changes) or without top_p,
and rows whose cumulative probabilities are not monotone (rounding) or not finite, take exact_filter.
"""
from __future__ import annotations

import numpy as np
import torch

from moeserve.sample.draw import argmax, bad_rows, exponential_noise
from moeserve.sample.filters import NEG_INF, exact_filter

MARGIN = 1e-5  # relative: ~80 float32 ulps, far beyond the roundings a different normaliser moves p / q by
TINY = torch.finfo(torch.float32).tiny


def sample_exact(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
                 generators: list[torch.Generator]) -> list[int | None]:
    """One token per row of x [n, V], logits rows divided by their temperatures (the filters' input; not
    written), None where the row cannot be sampled: each as torch.multinomial(exact_filter(x_row).softmax(-1),
    1, generator=generators[i]) draws it, consuming the same random numbers (draw.exponential_noise)."""
    n, V = x.shape
    fast = [i for i in range(n) if top_p[i] < 1.0 and min_p[i] <= 0.0] if V > 1 else []
    slow = [i for i in range(n) if i not in fast]
    unsure: dict[int, tuple[torch.Tensor, float]] = {}  # row -> (its x, v): ties with v undecided
    parts: list[tuple[list[int], torch.Tensor]] = []  # (rows, their probabilities)
    if fast:
        everyone = len(fast) == n  # the usual case: no copies of the rows
        sel = None if everyone else torch.tensor(fast)
        written = any(0 < top_k[i] < V for i in fast)  # _boundaries writes x's top-k rows
        xk, bounds = _boundaries(x.index_select(0, sel) if not everyone else x.clone() if written else x,
                                 [top_k[i] for i in fast], [top_p[i] for i in fast])
        ok = [j for j, b in enumerate(bounds) if b is not None]
        slow += [fast[j] for j in range(len(fast)) if bounds[j] is None]
        if ok:
            rows = xk if len(ok) == len(fast) else xk.index_select(0, torch.tensor(ok))
            # the old rows when no tie is cut (row-wise ops: each row's bits as alone): x < v masked, as
            # x <= the float32 below v by a vectorised threshold per row (a bool mask costs ~5x that here)
            cut = rows.clone()
            below = torch.nextafter(torch.tensor([bounds[j][0] for j in ok], dtype=torch.float32),
                                    torch.tensor(NEG_INF)).tolist()
            for k, t in enumerate(below):
                torch.nn.functional.threshold_(cut[k], t, NEG_INF)
            parts.append(([fast[j] for j in ok], cut.softmax(-1)))
            for k, j in enumerate(ok):
                if bounds[j][1]:
                    unsure[fast[j]] = (rows[k], bounds[j][0])
    if slow:
        slow.sort()
        parts.append((slow, _old(x, top_k, top_p, min_p, slow)))
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        probs = parts[0][1]
    else:
        probs = torch.empty(n, V)
        for rows_, p in parts:
            probs[torch.tensor(rows_)] = p
    bad = bad_rows(probs)  # an unsure row keeps its finite best token: never bad
    q = exponential_noise(probs, generators, bad)
    ratio = probs / q
    tokens = argmax(ratio).tolist()
    if unsure:
        rows = sorted(unsure)
        # the winner's ratio and the runner-up's: the best after the winner is zeroed (ratios are >= 0 or NaN,
        # NaN wins amax: a redo); one amax, not a topk
        sub = ratio if len(rows) == n else ratio.index_select(0, torch.tensor(rows))  # ratio is not read after
        won = torch.tensor([tokens[i] for i in rows])[:, None]
        first = sub.gather(1, won)[:, 0].tolist()
        second = sub.scatter_(1, won, 0.0).amax(-1).tolist()
        redo = []
        for i, a, b in zip(rows, first, second):
            t = tokens[i]
            xi, v = unsure[i]
            # a near tie, the winner a tie with v, or its probability subnormal (roundings no longer relative)
            if not a > b * (1 + MARGIN) or float(xi[t]) == v or not float(probs[i, t]) >= TINY:
                redo.append(i)
        if redo:  # the old filter with its sort, on the same noise
            sel = torch.tensor(redo)
            p = _old(x, top_k, top_p, min_p, redo)
            for i, t in zip(redo, argmax(p / q.index_select(0, sel)).tolist()):
                tokens[i] = t
    return [None if b else t for t, b in zip(tokens, bad)]


def _old(x, top_k, top_p, min_p, rows: list[int]) -> torch.Tensor:
    sel = torch.tensor(rows)
    return exact_filter(x.index_select(0, sel), [top_k[i] for i in rows], [top_p[i] for i in rows],
                        [min_p[i] for i in rows]).softmax(-1)


def _boundaries(x: torch.Tensor, top_k: list[int],
                top_p: list[float]) -> tuple[torch.Tensor, list[tuple[float, bool] | None]]:
    """x [m, V], rows divided by their temperatures (its top-k rows are written) -> x after top-k as
    exact_filter computes it; per row (v, tied): the nucleus's last value as the old sort found it and
    whether tokens past the nucleus tie with it, or None (take the old filter)."""
    m, V = x.shape
    krows = [j for j in range(m) if 0 < top_k[j] < V]
    if krows:  # exact_filter's top-k on x (the k-th largest is also srt[k - 1], masked below)
        sel = torch.tensor(krows)
        rows = x.index_select(0, sel)
        ks = torch.tensor([top_k[j] for j in krows])
        kth = rows.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        x[sel] = rows.masked_fill(rows < kth, NEG_INF)
    # x's values, descending: the old sort's values whatever its order of ties (numpy's vectorised sort)
    srt = torch.from_numpy(np.ascontiguousarray(np.sort(x.numpy(), axis=-1)[:, ::-1]))
    probs = srt.softmax(-1)  # exact_filter's top-p, on the same values in the same order
    p32 = torch.tensor(top_p, dtype=torch.float32)[:, None]
    before = probs.cumsum(-1).sub_(probs)  # the old filter drops a token once the mass before it reaches top_p,
    # the first one never: its kept count k where before[1:k] < top_p <= before[k:] (then the mask it built is
    # that prefix kept, the rest dropped). k from a binary search, the two sides checked by two reductions a row
    # (else the row takes the old filter; NaN fails the checks)
    k = torch.searchsorted(before, p32)[:, 0].clamp_(min=1)
    monotone = []
    for row, kj, pj in zip(before, k.tolist(), p32[:, 0].tolist()):
        monotone.append((kj == 1 or float(row[1:kj].amax()) < pj) and (kj == V or float(row[kj:].amin()) >= pj))
    monotone = torch.tensor(monotone)
    v = srt.gather(1, (k - 1)[:, None])[:, 0]
    after = srt.gather(1, k.clamp(max=V - 1)[:, None])[:, 0]
    tied = (k < V) & (after == v)
    ok = monotone & torch.isfinite(v) & torch.isfinite(srt[:, 0])
    return x, [(vj, tj) if oj else None for vj, tj, oj in zip(v.tolist(), tied.tolist(), ok.tolist())]
