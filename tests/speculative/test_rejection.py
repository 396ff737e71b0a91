"""Rejection sampling keeps the main model's distribution (statistical tests on a 6-token vocabulary)."""
import torch

from moeserve.sampling_params import SamplingParams
from moeserve.sample.rejection import RejectionSampler, accept_greedy, rejection_sample

V, N = 6, 12000
CHI2_CRIT = 25.7  # chi-square, 5 degrees of freedom, p = 1e-4: a correct sampler fails this 1 time in 10^4


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def target_logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def test_one_hot_drafts_first_and_second_tokens_follow_the_target():
    logits = target_logits(0, 3)  # 2 drafts + bonus row
    params = SamplingParams(temperature=0.8)
    p = (logits / 0.8).softmax(-1)
    drafts = [int(p[0].argmax()), int(p[1].argmin())]  # a likely and an unlikely draft
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        out = rejection_sample(logits, drafts, params, g)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1  # given the first draft was accepted, token 2 ~ p[1]
    assert chi2(first, p[0]) < CHI2_CRIT
    assert chi2(second, p[1]) < CHI2_CRIT
    # The test has power: the same counts are far from a slightly different distribution.
    assert chi2(first, (logits[0] / 0.7).softmax(-1)) > 4 * CHI2_CRIT


def test_sampled_drafts_with_their_probabilities_follow_the_target():
    logits = target_logits(2, 2)
    params = SamplingParams(temperature=1.0)
    p = logits.softmax(-1)
    q = target_logits(3, 1).softmax(-1)  # [1, V] a different draft distribution
    g = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    drafts = torch.multinomial(q[0], N, replacement=True, generator=g).tolist()
    for x in drafts:
        counts[rejection_sample(logits, [x], params, g, draft_probs=q)[0]] += 1
    assert chi2(counts, p[0]) < CHI2_CRIT
    naive = torch.bincount(torch.tensor(drafts), minlength=V).float()  # always accepting would give q
    assert chi2(naive, p[0]) > 4 * CHI2_CRIT


def test_filters_apply_to_the_target_distribution():
    logits = target_logits(5, 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    top2 = set(logits[0].topk(2).indices.tolist())
    outside = next(t for t in range(V) if t not in top2)
    g = torch.Generator().manual_seed(6)
    firsts = {rejection_sample(logits, [outside], params, g)[0] for _ in range(500)}
    assert firsts == top2  # the draft outside top-k is never accepted


def test_greedy_acceptance_and_batched_rows():
    assert accept_greedy([4, 2, 7], [4, 2]) == [4, 2, 7]
    assert accept_greedy([4, 2, 7], [4, 3]) == [4, 2]
    assert accept_greedy([5], []) == [5]
    logits = torch.full((5, V), -5.0)
    for row, tok in enumerate([1, 2, 3, 0, 4]):
        logits[row, tok] = 5.0
    sampler = RejectionSampler(0)
    greedy = SamplingParams(temperature=0)
    # request A: drafts [1, 5] -> rows 0..2, accepts 1 then corrects; request B: no drafts -> row 3; C: row 4
    out = sampler(logits, [[1, 5], [], []], [greedy] * 3, [None] * 3)
    assert out == [[1, 2], [0], [4]]
