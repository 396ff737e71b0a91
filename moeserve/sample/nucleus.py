"""The top-p nucleus of rows over a whole vocabulary (flat distributions, whose nucleus the best candidates
do not hold): the shortest prefix of the sorted probabilities reaching top_p, and the tokens tied with its last
one.

The row's probabilities sorted by value (numpy's vectorised sort: values only, no indices to carry) and
their float32 running sum, as the per-request filter sums them (filters.exact_filter: a token is dropped once
the mass above it reaches top_p), give the last kept probability, the row's floor: the nucleus is every
token at or above it. About 100 us a row at V = 32000, a third of the radix select on the logits' bits it
replaced (~25 small integer ops per digit level).
"""
from __future__ import annotations

import numpy as np
import torch


def nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[m] the smallest probability in each row's nucleus. probs [m, V] float32 (each row sums to ~1), top_p [m, 1]."""
    V = probs.shape[1]
    srt = torch.from_numpy(np.sort(probs.contiguous().numpy(), axis=-1))  # ascending
    # a token is kept while the mass above it is below top_p: total - (its running sum from the bottom) < top_p;
    # the running sums from the bottom never decrease (non-negative terms), so the kept ones are a suffix
    low = srt.cumsum(-1)
    first = torch.searchsorted(low, low[:, -1:] - top_p, right=True).clamp_(max=V - 1)  # the best token stays
    return srt.gather(1, first)[:, 0]


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [m, V]: the top-p nucleus of each row of probs [m, V] (top_p [m, 1])."""
    return probs >= nucleus_floor(probs, top_p)[:, None]


def cut_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """probs outside their rows' nucleus set to 0, in place."""
    # zero p <= the float32 below the floor: a vectorised threshold_ per row (a bool mask costs ~5x that)
    below = torch.nextafter(nucleus_floor(probs, top_p), torch.tensor(float("-inf"))).tolist()
    for row, t in zip(probs, below):
        torch.nn.functional.threshold_(row, t, 0.0)
