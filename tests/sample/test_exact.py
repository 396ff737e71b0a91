"""Seeded rows without the full sort (moeserve/sample/exact.py) against the per-request loop: same tokens and
generator states on flat rows full of bfloat16 ties, where the nucleus's last value is tied nearly always."""
import torch

from moeserve.sample.exact import _boundaries, sample_exact
from moeserve.sample.sampler import scale
from moeserve.sampling_params import SamplingParams
from tests.sample.reference import old_sample


def test_seeded_rows_without_the_sort_draw_the_old_tokens_and_streams():
    V, g = 32000, torch.Generator().manual_seed(21)
    rows = [  # (temperature, top_k, top_p, min_p, logit scale, bfloat16 values)
        (0.6, -1, 0.95, 0.0, 0.5, True), (0.7, -1, 0.9, 0.0, 0.3, True), (1.0, -1, 0.5, 0.0, 1.0, True),
        (1.3, -1, 0.99, 0.0, 3.0, True), (0.8, 40, 0.95, 0.0, 0.5, True), (0.8, 2000, 0.9, 0.0, 0.5, True),
        (0.7, -1, 0.9, 0.0, 0.5, False), (0.9, -1, 0.9, 0.02, 0.5, True), (1.0, -1, 1.0, 0.0, 0.5, True),
        (0.5, -1, 0.9, 0.0, 8.0, True), (1.0, -1, 1e-46, 0.0, 0.5, True),
        (1.0, -1, 0.5, 0.0, 0.0, True), (0.8, -1, 0.9, 0.0, 0.0, True), (1.0, 100, 0.7, 0.0, 0.0, True),
    ]  # scale 0: a few values in steps of 0.5, so the winner is often a tie the old sort kept or not
    n = len(rows)
    T = torch.tensor([r[0] for r in rows])
    top_k, top_p, min_p = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    tied = untied = 0
    for step in range(12):
        logits = torch.randn(n, V, generator=g) * torch.tensor([r[4] for r in rows])[:, None]
        coarse = torch.tensor([r[4] == 0.0 for r in rows])
        logits[coarse] = (torch.randn(int(coarse.sum()), V, generator=g) * 2).round() / 2
        logits = logits.bfloat16().float()
        logits[6] = logits[6] / 1.1  # no longer bfloat16 values (as after a repetition penalty): the float sort
        logits[torch.rand(n, V, generator=g) < 0.02] = float("-inf")
        params = [SamplingParams(temperature=r[0], top_k=r[1], top_p=r[2], min_p=r[3], seed=1000 * step + i)
                  for i, r in enumerate(rows)]
        new = [torch.Generator().manual_seed(p.seed) for p in params]
        old = [torch.Generator().manual_seed(p.seed) for p in params]
        got = sample_exact(scale(logits, T), top_k, top_p, min_p, new)
        assert got == old_sample(logits, params, old, torch.Generator())
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(new, old))
        _, bounds = _boundaries(scale(logits, T), top_k, top_p)
        tied += sum(1 for b in bounds if b is not None and b[1])
        untied += sum(1 for b in bounds if b is not None and not b[1])
    assert tied > 50 and untied > 5  # both cases ran: ties cut by the nucleus (flat rows) and clean ones


def test_a_seeded_row_that_cannot_be_sampled_leaves_its_generator():
    V = 64
    logits = torch.randn(2, V).bfloat16().float()
    logits[0] = float("-inf")
    logits[0, 3] = float("nan")
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    before = gens[0].get_state()
    got = sample_exact(scale(logits, torch.tensor([0.7, 0.7])), [-1, -1], [0.9, 0.9], [0.0, 0.0], gens)
    want = old_sample(logits, [SamplingParams(temperature=0.7, top_p=0.9, seed=s) for s in (1, 2)],
                      [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], torch.Generator())
    assert got == want and got[0] is None and torch.equal(gens[0].get_state(), before)
