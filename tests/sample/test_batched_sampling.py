"""The batched sampler against the per-request loop it replaced (tests/sample/reference.py)."""
import random

import pytest
import torch

from moeserve.sample import SamplingBatch, Sampler, exact_filter, filtered_probs
from moeserve.sample.sampler import scale
from moeserve.sample.filters import CANDIDATES, candidate_filter
from moeserve.sampling_params import SamplingParams
from moeserve.sample.rejection import RejectionSampler
from tests.sample.reference import (old_apply_filters, old_logprobs, old_rejection_sample, old_sample)

CHI2_CRIT_7DOF = 24.3  # chi-square, 7 degrees of freedom, p = 1e-3


def random_params(rng: random.Random, V: int, seeded: bool | None = None, greedy_share: float = 0.15) -> SamplingParams:
    if rng.random() < greedy_share:
        return SamplingParams(temperature=0.0, seed=rng.randrange(2**32) if seeded else None)
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.3]),
        top_k=rng.choice([-1, -1, 1, 5, 50, V - 1, V, V + 10]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.9, 0.5, 1e-46]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        seed=(rng.randrange(-2**63, 2**63) if seeded or (seeded is None and rng.random() < 0.5) else None),
        logprobs=rng.choice([None, 0, 1, 5]))


def model_like_logits(rows: int, V: int, seed: int) -> torch.Tensor:
    """bfloat16 values in float32 (compute_logits' output): many exact ties, some tokens masked."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, V, generator=g) * torch.rand(rows, 1, generator=g) * 6).bfloat16().float()
    x[torch.rand(rows, V, generator=g) < 0.05] = float("-inf")
    return x


@pytest.mark.parametrize("V", [50, 4096, 32000])
def test_exact_filter_is_the_old_filter_bit_for_bit(V):
    rng = random.Random(V)
    params = [random_params(rng, V) for _ in range(24)]
    params = [p for p in params if not p.greedy]
    logits = model_like_logits(len(params), V, V)
    got = exact_filter(scale(logits, torch.tensor([p.temperature for p in params])), [p.top_k for p in params],
                       [p.top_p for p in params], [p.min_p for p in params])
    for i, p in enumerate(params):
        assert torch.equal(got[i], old_apply_filters(logits[i], p)), (i, p)


@pytest.mark.parametrize("V", [64, 32000])
def test_seeded_rows_draw_the_old_tokens_and_consume_the_same_stream(V):
    """Same seeds, same tokens: every seeded row of a mixed batch draws what the per-request loop drew,
    step after step (the generators advance alike), whatever the other rows are."""
    rng = random.Random(7)
    B = 20
    params = [random_params(rng, V, seeded=i % 3 != 0) for i in range(B)]
    new_gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    old_gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    sampler = Sampler(0)
    for step in range(4):
        logits = model_like_logits(B, V, 100 + step)
        errors: dict[int, str] = {}
        got, _ = sampler(logits, params, new_gens, errors=errors)
        want = old_sample(logits, params, old_gens, torch.Generator().manual_seed(1))
        for i, p in enumerate(params):
            if p.seed is not None or p.greedy:
                assert (None if i in errors else got[i]) == want[i], (step, i, p)
    for a, b in zip(new_gens, old_gens):
        if a is not None:
            assert torch.equal(a.get_state(), b.get_state())


def test_candidate_rows_keep_the_old_support_and_probabilities():
    """Rows without a seed of their own are filtered on candidates (top-k, 256 candidates, the whole row):
    on logits without ties they keep exactly the tokens the old filter kept, with its probabilities."""
    V, g = 32000, torch.Generator().manual_seed(3)
    scales = [8.0, 3.0, 0.5, 0.01, 3.0, 1.0, 3.0, 1.0]  # peaked (256 candidates), wide, flat...
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.9),
              SamplingParams(top_p=0.5, temperature=0.7), SamplingParams(top_k=40, top_p=0.8),
              SamplingParams(top_k=1000, min_p=0.1), SamplingParams(min_p=0.05, temperature=1.3),
              SamplingParams(temperature=0.9)]
    logits = torch.randn(len(params), V, generator=g) * torch.tensor(scales)[:, None]
    batch = SamplingBatch.build(params, [None] * len(params))
    assert batch.candidate_rows == list(range(len(params)))
    rows = batch.candidate_rows
    groups = candidate_filter(batch.scaled(logits, rows), *batch.select(rows))
    sizes = {len(c.probs[0]) for _, c in groups}
    assert {1000, CANDIDATES, V} <= sizes  # every path was exercised (top-k: the largest k)
    got = filtered_probs(logits, batch)
    for i, p in enumerate(params):
        want = old_apply_filters(logits[i], p).softmax(-1)
        assert torch.equal(got[i] > 0, want > 0), i
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-7)


def test_candidate_draws_follow_the_filtered_distribution():
    V, N = 8, 20000
    base = torch.randn(1, V, generator=torch.Generator().manual_seed(11)) * 1.5
    for p in (SamplingParams(temperature=0.8), SamplingParams(top_k=4), SamplingParams(top_p=0.7),
              SamplingParams(min_p=0.1, temperature=1.2)):
        tokens, _ = Sampler(5)(base.expand(N, V).contiguous(), [p] * N, [None] * N)
        counts = torch.bincount(torch.tensor(tokens), minlength=V).float()
        probs = old_apply_filters(base[0], p).softmax(-1)
        keep = probs > 0
        assert counts[~keep].sum() == 0, p
        expected = probs * N
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2 < CHI2_CRIT_7DOF, (p, chi2)
        wrong = (base[0] / 0.5).softmax(-1)  # the test has power: far from a different distribution
        assert float(((counts - wrong * N) ** 2 / (wrong * N)).sum()) > 4 * CHI2_CRIT_7DOF


def test_a_row_that_cannot_be_sampled_fails_alone():
    V = 100
    params = [SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.9), SamplingParams(), SamplingParams(top_k=5),
              SamplingParams(temperature=0)]
    logits = model_like_logits(len(params), V, 5)
    logits[1, 3] = float("nan")
    logits[3] = float("-inf")
    errors: dict[int, str] = {}
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    tokens, _ = Sampler(0)(logits, params, gens, errors=errors)
    assert sorted(errors) == [1, 3] and tokens[1] == tokens[3] == 0
    assert tokens[0] == old_sample(logits[:1], params[:1], [torch.Generator().manual_seed(1)], None)[0]
    assert tokens[4] == int(logits[4].argmax())
    with pytest.raises(ValueError, match="not finite"):
        Sampler(0)(logits, params, gens)


def test_logprobs_are_the_old_ones():
    V, rng = 500, random.Random(2)
    params = [random_params(rng, V) for _ in range(16)]
    logits = model_like_logits(len(params), V, 9)
    logits[logits.isinf()] = -30.0  # raw model logits are finite
    tokens, lps = Sampler(0)(logits, params, [None] * len(params))
    want = old_logprobs(logits, params, tokens)
    assert [None if x is None else (x.token_id, x.logprob, x.top) for x in lps] == want


@pytest.mark.parametrize("V", [40, 64, 4096])  # below and above topk's partial-sort length
def test_one_top_logprob_is_the_first_of_equal_maxima_as_before(V):
    """logprobs=1 takes the row's first maximum (max), as the old topk(1) did, among many equal maxima."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randint(0, 3, (12, V), generator=g).float()  # every row's maximum tied many times
    params = [SamplingParams(temperature=0, logprobs=1)] * 12
    tokens, lps = Sampler(0)(logits, params, [None] * 12)
    want = old_logprobs(logits, params, tokens)
    assert [(x.token_id, x.logprob, x.top) for x in lps] == want


def test_batch_rows_and_paths():
    params = [SamplingParams(temperature=0), SamplingParams(seed=3), SamplingParams(top_p=0.5)]
    gens = [None, torch.Generator().manual_seed(3), None]
    b = SamplingBatch.build(params, gens, num_rows=[2, 1, 3])
    assert len(b) == 6
    assert (b.greedy_rows, b.exact_rows, b.candidate_rows) == ([0, 1], [2], [3, 4, 5])
    assert b.top_p == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5] and b.temperature.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert SamplingBatch.build(params[:1], gens[:1]).all_greedy


def test_rejection_sampler_seeded_requests_as_before():
    """A seeded request's verification in a batch with others is the old per-request rejection sampling."""
    V, rng = 300, random.Random(4)
    drafts = [[3, 7], [], [1], [5, 5, 5], [2]]
    params = [random_params(rng, V, seeded=True, greedy_share=0.0) for _ in drafts]
    params[4] = SamplingParams(top_p=0.8)  # an unseeded one beside them
    logits = model_like_logits(sum(len(d) + 1 for d in drafts), V, 21)
    for r in range(logits.shape[0]):  # make the drafts likely enough to be accepted sometimes
        logits[r, :10] = logits[r].max() + torch.arange(10.0) * 0.1
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    old = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    for _ in range(5):
        out = RejectionSampler(0)(logits, drafts, params, gens)
        row = 0
        for i, (d, p) in enumerate(zip(drafts, params)):
            if p.seed is not None:
                assert out[i] == old_rejection_sample(logits[row: row + len(d) + 1], d, p, old[i])
            row += len(d) + 1


def test_rejection_sampler_unseeded_rows_keep_the_target_distribution():
    V, N = 6, 8000
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    p0 = old_apply_filters(logits[0], params).softmax(-1)
    draft = int(p0.argmax())
    out = RejectionSampler(1)(logits.repeat(N, 1), [[draft]] * N, [params] * N, [None] * N)
    counts = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float()
    keep = p0 > 0
    assert counts[~keep].sum() == 0
    chi2 = float(((counts[keep] - p0[keep] * N) ** 2 / (p0[keep] * N)).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 1e-3


def test_non_finite_rows_is_the_old_definition():
    """NaN or +inf anywhere, or every entry -inf; a -inf entry alone is a masked token."""
    from moeserve.sample.step import non_finite_rows

    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 1000, generator=g)
    for r in range(64):
        kind, col = r % 5, int(torch.randint(0, 1000, (1,), generator=g))
        if kind == 0:
            x[r, col] = float("nan")
        elif kind == 1:
            x[r, col] = float("inf")
        elif kind == 2:
            x[r] = float("-inf")
        elif kind == 3:
            x[r, col] = float("-inf")
    finite = torch.isfinite(x)
    want = ~(finite | torch.isneginf(x)).all(-1) | ~finite.any(-1)
    assert torch.equal(non_finite_rows(x), want) and int(want.sum()) == 39


def test_flat_top_p_rows_bfloat16_radix_path_and_float_sort_path_agree():
    """Flat rows (the nucleus beyond 256 candidates): rows of bfloat16 values take the radix sort of their
    keys, others a float sort; both keep the old filter's tokens plus, at most, the tokens tied with the
    nucleus's last value (the old sort kept an arbitrary share of those)."""
    from moeserve.sample.nucleus import nucleus as _nucleus

    V, g = 32000, torch.Generator().manual_seed(12)
    raw = (torch.randn(6, V, generator=g) * torch.tensor([0.3, 0.5, 1.0, 0.3, 0.5, 1.0])[:, None]).bfloat16().float()
    raw[3:] = raw[3:] / 1.1  # no longer bfloat16 values (as after a repetition penalty): the float path
    T = torch.tensor([0.7, 1.0, 1.3, 0.7, 1.0, 1.3])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 0.5, 0.95])[:, None]
    probs = (raw / T[:, None]).softmax(-1)
    keep = _nucleus(probs, top_p)
    for i in range(6):
        old = old_apply_filters(raw[i], SamplingParams(temperature=float(T[i]), top_p=float(top_p[i]))).isfinite()
        assert bool((keep[i] | ~old).all()), i  # everything the old filter kept
        extra = keep[i] & ~old
        boundary = raw[i][old].min()
        assert bool((raw[i][extra] == boundary).all()), i  # and only ties with its last value
    # the float path on the same order and ties (values scaled by 1 + 2^-20: no longer bfloat16) keeps the
    # same tokens as the radix path
    scaled = raw[:3] * (1 + 2**-20)
    assert torch.equal(_nucleus((scaled / T[:3, None]).softmax(-1), top_p[:3]), keep[:3])


def test_two_level_draw_over_a_whole_vocabulary_follows_the_probabilities():
    """Rows over a whole vocabulary draw in two levels (blocks, then a token of the block): the tokens
    follow the row's probabilities, block edges and zeros included."""
    from moeserve.sample.draw import BLOCK, draw_candidates
    from moeserve.sample.filters import Candidates

    V, N = 5000, 30000  # not a multiple of BLOCK: the last block is padded
    tokens = [0, BLOCK - 1, BLOCK, 3 * BLOCK + 7, 4000, V - 1, 17, 2 * BLOCK - 1]
    weights = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.12, 0.08])
    probs = torch.zeros(V)
    probs[tokens] = weights * 3.0  # rows need not sum to 1
    got = draw_candidates(Candidates(probs.expand(N, V).contiguous(), None), torch.Generator().manual_seed(3))
    counts = torch.bincount(torch.tensor(got), minlength=V).float()
    assert counts.sum() == N and counts[probs == 0].sum() == 0
    expected = weights * N
    chi2 = float(((counts[tokens] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_7DOF, chi2
    shifted = torch.roll(weights, 1) * N  # the test has power: the same counts are far from other weights
    assert float(((counts[tokens] - shifted) ** 2 / shifted).sum()) > 4 * CHI2_CRIT_7DOF


def test_argmax_is_atens():
    """draw.argmax (numpy's for CPU float32) gives ATen's argmax: the first maximum, NaN above everything,
    -0.0 and 0.0 equal; 1-D and 2-D; other dtypes through ATen."""
    from moeserve.sample.draw import argmax

    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (64, 3000), generator=g).float()  # many equal maxima
    x[5, 17] = x[5, 40] = float("nan")
    x[6] = 0.0
    x[6, 3:9] = -0.0
    x[7] = float("-inf")
    for rows in (x, x[:, ::2], x[9]):
        assert torch.equal(argmax(rows), rows.argmax(-1))
    assert torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(-1))


@pytest.mark.parametrize("in_path_order", [True, False])
def test_writable_logits_give_the_same_tokens_and_logprobs(in_path_order):
    """Sampler(..., writable=True) scales the rows of each path where they are (path_order puts them
    together): the same tokens, logprobs (of the raw rows) and generator states as on a copy, the caller's
    logits left as they were when not writable."""
    from moeserve.sample.sampler import path_order

    V, rng = 4096, random.Random(31)
    params = [random_params(rng, V) for _ in range(40)]
    logits = model_like_logits(len(params), V, 17)
    logits[logits.isinf()] = -30.0  # raw model logits are finite
    if in_path_order:
        order = path_order(params)
        params, logits = [params[i] for i in order], logits[order]
        kinds = [0 if p.greedy else 1 if p.seed is not None else 2 for p in params]
        assert kinds == sorted(kinds)  # greedy, seeded, then the candidate rows

    def run(writable: bool):
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        x = logits.clone()
        tokens, lps = Sampler(3)(x, params, gens, writable=writable)
        return tokens, [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in lps], \
            [g.get_state() for g in gens if g is not None], x

    tokens, lps, states, untouched = run(False)
    assert torch.equal(untouched, logits)
    w_tokens, w_lps, w_states, _ = run(True)
    assert w_tokens == tokens and w_lps == lps
    assert all(torch.equal(a, b) for a, b in zip(states, w_states))
