"""Drawing tokens from filtered distributions, a batch of rows at once.

- exponential_noise: the Exp(1) noise torch.multinomial(probs[i], 1, generator=g_i) draws row by row (on CPU
  multinomial draws one sample as argmax(probs / q) with q ~ Exp(1) filled from the generator, ATen's
  Distributions.cpp), each row's from its own generator (the same stream a seeded request consumed before),
  the log for the batch at once; sample/exact.py divides and takes the argmax.
- draw_candidates: rows without a seed of their own: one uniform per row from the shared generator, then
  the inverse CDF over the row's candidates (a cumsum and a searchsorted for the batch).
"""
from __future__ import annotations

import numpy as np
import torch

from moeserve.sample.filters import Candidates

MESSAGE = ("its token probabilities are not finite (NaN or inf) after temperature, top-k, top-p and min-p; lower "
           "the logit scale (temperature, logit_bias, penalties)")


class SamplingError(ValueError):
    """One row cannot be sampled (its distribution is not finite): that request fails, the others go on."""


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) as ATen gives it (the first maximum; NaN above everything), by numpy's vectorised argmax for
    CPU float32 rows: ATen's CPU argmax is a scalar loop, ~12x slower on [32, 32000] logits here (1.5 ms)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() <= 2:
        return torch.as_tensor(np.argmax(x.detach().contiguous().numpy(), axis=-1))
    return x.argmax(-1)


def bad_rows(probs: torch.Tensor) -> list[bool]:
    """Rows [n, K] (probabilities, >= 0 or NaN) that cannot be drawn from: a non-finite entry, or nothing
    above 0; both show in the row's sum (NaN, inf, or not above 0)."""
    total = probs.sum(-1)
    return (~(total > 0) | torch.isinf(total)).tolist()


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V]; SamplingError instead of multinomial's RuntimeError (a temperature that
    overflowed the logits to inf gives NaN probabilities)."""
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise SamplingError(MESSAGE)
    return int(torch.multinomial(probs, 1, generator=generator))


def exponential_noise(probs: torch.Tensor, generators: list[torch.Generator], bad: list[bool]) -> torch.Tensor:
    """q [n, V] ~ Exp(1) with the bits torch.multinomial(probs[i], 1, generator=generators[i]) draws on CPU
    (argmax(probs / q), ATen's Distributions.cpp), leaving each generator where it would; bad rows (that
    cannot be sampled) consume nothing, as the old draw raised before multinomial touched the generator.
    exponential_ is float32(-log1p(-u)) of the generator's float64 uniforms u, element by element (scalar
    log1p, ~4x the uniforms' cost): u per row and one vectorised log1p for the batch give the same bits
    (tests/sample: tokens and generator states)."""
    u = torch.empty(probs.shape, dtype=torch.float64)
    for i, g in enumerate(generators):
        if bad[i]:
            u[i] = 0.5  # any value: the row's token is dropped
        else:
            u[i].uniform_(0.0, 1.0, generator=g)
    # -x rounds to float32 as -(x rounded): the last negation on the float32 copy, half the bytes
    return torch.log1p(u.neg_(), out=u).to(probs.dtype).neg_()


def draw_candidates(c: Candidates, generator: torch.Generator) -> list[int | None]:
    """One token per row of c (None: that row cannot be sampled): token j with probability
    c.probs[i, j] / c.probs[i].sum(), from one uniform per row of the shared generator (inverse CDF; over
    a whole vocabulary in two levels: blocks of BLOCK tokens, then the tokens of the chosen block)."""
    probs = c.probs
    n, K = probs.shape
    u = torch.rand(n, dtype=torch.float64, generator=generator)
    if K <= 2 * BLOCK:
        bad = bad_rows(probs)
        pos = _inverse_cdf(probs, u)
    else:
        nb = -(-K // BLOCK)
        blocks = probs if K == nb * BLOCK else torch.nn.functional.pad(probs, (0, nb * BLOCK - K))
        blocks = blocks.view(n, nb, BLOCK)
        # [n, nb]: float32 block sums (pairwise: ~1e-7 relative), then float64 (sum(dtype=float64) would
        # first copy every row to float64)
        mass = blocks.sum(-1).to(torch.float64)
        bad = bad_rows(mass)  # the row's sum shows it as well (NaN, inf, nothing above 0): no pass of its own
        b = _inverse_cdf(mass, u)
        cdf = mass.cumsum(-1)
        below = (cdf.gather(1, b[:, None])[:, 0] - mass.gather(1, b[:, None])[:, 0]) / cdf[:, -1]
        inner = blocks[torch.arange(n), b]  # [n, BLOCK] the chosen block
        # u's position inside the chosen block, in [0, 1)
        v = ((u - below) / (mass.gather(1, b[:, None])[:, 0] / cdf[:, -1])).clamp(0.0, 1.0 - 2**-53)
        pos = b * BLOCK + _inverse_cdf(inner, v)
    tokens = (pos if c.ids is None else c.ids.gather(1, pos[:, None])[:, 0]).tolist()
    return [None if b else t for t, b in zip(tokens, bad)]


BLOCK = 256


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index per row of probs [n, K] (>= 0, each row with some mass) at the uniform u [n] (float64):
    the first whose cumulative mass exceeds u x the row's total, never a column of probability 0."""
    K = probs.shape[1]
    cdf = probs.to(torch.float64).cumsum(-1)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total may round up to the total: never past the last column of nonzero probability
    last = (K - 1) - (probs > 0).flip(-1).to(torch.uint8).argmax(-1)
    return torch.minimum(pos, last)
