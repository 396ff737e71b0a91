"""Temperature, top-k, top-p and min-p for a batch of logits rows at once.

Two paths, chosen per row by moeserve/sample/batch.py:

- exact (requests with their own seed): the distribution is the one the per-request loop computed before
  (layers/sampler.apply_filters at commit 22b2f4d), bit for bit, so a seed keeps giving the same tokens:
  every op is the old one applied to a [n, V] batch (row-wise ops give each row the bits they gave it alone;
  the top-p sort is one batched sort of the top-k-masked rows, so ties at the top-p boundary fall as before).
- candidates (every other sampled row): top-k and top-p work on the row's best candidates only (one
  batched topk per step instead of a full-vocabulary sort per request), then min-p; the draw picks among
  the candidates (draw.draw_candidates). A top-p row whose nucleus its 256 best tokens do not hold uses the
  whole vocabulary (a values-only sort, a radix sort of bfloat16 keys where the row's values are bfloat16,
  finds the nucleus's last value; tokens tied with it are kept).
"""
from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")
# rows with top_p and no top_k first try their best CANDIDATES tokens (one batched topk), unless their best
# probability shows those cannot reach top_p; the rows they do not cover use the whole vocabulary
CANDIDATES = 256


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [n, V] / temperature [n]; masked (-inf) entries stay masked (-inf / a temperature that
    overflows float32 would be NaN; a finite one leaves +-inf as it is, so then no where is needed)."""
    if bool(torch.isfinite(temperature).all()):
        return logits / temperature[:, None]
    return torch.where(torch.isinf(logits), logits, logits / temperature[:, None])


def exact_filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float],
                 min_p: list[float]) -> torch.Tensor:
    """Filtered logits [n, V] (masked entries -inf): row i as apply_filters gave it for its parameters,
    bit for bit. top_k[i] <= 0 or >= V: off; top_p[i] >= 1: off; min_p[i] <= 0: off."""
    n, V = logits.shape
    x = scale(logits, temperature)
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


def candidate_filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float],
                     min_p: list[float]) -> list[tuple[list[int], Candidates]]:
    """The rows' filtered distributions as Candidates, grouped: [(row indices, Candidates)], each group
    from one batched op. top-k keeps exactly k tokens (the topk's, ties beyond it dropped); top-p the
    shortest prefix of the sorted candidates whose probability (under the top-k-filtered row) reaches
    top_p; min-p drops probabilities below min_p x the best one."""
    n, V = logits.shape
    x = scale(logits, temperature)
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
        probs = x.index_select(0, torch.tensor(prows)).softmax(-1)
        p = torch.tensor([top_p[i] for i in prows], dtype=torch.float32)
        left = list(range(len(prows)))
        if CANDIDATES < V:  # the best CANDIDATES tokens, for rows whose best probability does not rule it out
            tried = [j for j, h in enumerate((CANDIDATES * probs.amax(-1) < p).tolist()) if not h]
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
            sel = torch.tensor(left)
            rows = [prows[j] for j in left]
            probs = probs.index_select(0, sel)
            keep = _nucleus(logits.index_select(0, torch.tensor(rows)), probs,
                            temperature.index_select(0, torch.tensor(rows)), p.index_select(0, sel)[:, None])
            groups.append((rows, _finish(probs * keep, None, [1.0] * len(rows), [min_p[i] for i in rows])))
    rest = [i for i in range(n) if not 0 < top_k[i] < V and not top_p[i] < 1.0]
    if rest:  # temperature (and min-p) only: the whole vocabulary, unsorted
        probs = x.index_select(0, torch.tensor(rest)).softmax(-1)
        groups.append((rest, _finish(probs, None, [1.0] * len(rest), [min_p[i] for i in rest])))
    return groups


def _nucleus(raw: torch.Tensor, probs: torch.Tensor, temperature: torch.Tensor,
             top_p: torch.Tensor) -> torch.Tensor:
    """bool [m, V]: the top-p nucleus of each row (the shortest prefix of the sorted probabilities reaching
    top_p [m, 1], and the tokens tied with its last one). raw [m, V]: the logits before temperature, probs
    their filtered softmax.

    Rows whose values are all bfloat16 ones (compute_logits' output, no processor changed them): their
    bfloat16 bits, as order-preserving int16 keys, sort by numpy's radix sort (O(V), several times a float
    sort); the sorted keys give the sorted values back, so the cumulative probability in sorted order and
    the nucleus's last key follow without sorting a float. Other rows: a values-only float sort (numpy's
    SIMD sort, about 3x torch.sort, which also sorts indices)."""
    V = raw.shape[1]
    keep = torch.empty(raw.shape, dtype=torch.bool)
    is_bf16 = (raw.bfloat16().float() == raw).all(-1).tolist()
    fast = [i for i, b in enumerate(is_bf16) if b]
    slow = [i for i, b in enumerate(is_bf16) if not b]
    if fast:
        sel = torch.tensor(fast)
        bits = raw.index_select(0, sel).bfloat16().view(torch.int16)
        key = bits ^ ((bits >> 15) & 0x7FFF)  # sign-magnitude -> two's complement order (an involution)
        desc = torch.from_numpy(np.ascontiguousarray(np.sort(key.numpy(), axis=-1, kind="stable")[:, ::-1]))
        values = (desc ^ ((desc >> 15) & 0x7FFF)).view(torch.bfloat16).float() / temperature.index_select(0, sel)[:, None]
        mass = (values - values[:, :1]).exp().cumsum(-1)  # the largest value first: no overflow
        last = (mass < top_p.index_select(0, sel) * mass[:, -1:]).sum(-1, keepdim=True).clamp(max=V - 1)
        keep[sel] = key >= desc.gather(1, last)
    if slow:
        sel = torch.tensor(slow)
        rows = probs.index_select(0, sel)
        desc = torch.from_numpy(np.ascontiguousarray(np.sort(rows.numpy(), axis=-1)[:, ::-1]))
        last = (desc.cumsum(-1) < top_p.index_select(0, sel)).sum(-1, keepdim=True).clamp(max=V - 1)
        keep[sel] = rows >= desc.gather(1, last)
    return keep


def _finish(probs: torch.Tensor, ids: torch.Tensor | None, top_p: list[float],
            min_p: list[float]) -> Candidates:
    """top-p (probs sorted descending when any top_p < 1) and min-p on candidate probabilities."""
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=torch.float32)[:, None]
        drop = probs.cumsum(-1) - probs >= p
        drop[:, 0] = False
        probs = probs * ~drop
    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, dtype=torch.float32)[:, None]
        probs = probs * (probs >= m * probs.amax(-1, keepdim=True))
    return Candidates(probs, ids)


def apply_filters(logits: torch.Tensor, p) -> torch.Tensor:
    """Temperature-scaled, filtered logits [V] for one request's SamplingParams p (masked entries -inf)."""
    return exact_filter(logits[None], torch.tensor([p.temperature], dtype=torch.float32), [p.top_k], [p.top_p],
                        [p.min_p])[0]
