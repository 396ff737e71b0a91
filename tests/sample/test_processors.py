"""The batched logits processors against the request-by-request loop (tests/sample/reference.py)."""
import random

import pytest
import torch

from moeserve.sample.processors import LogitsRows, apply_logits_processors
from moeserve.sampling_params import SamplingParams
from tests.sample.reference import old_apply_logits_processors


def random_rows(rng: random.Random, V: int, n: int) -> list[LogitsRows]:
    rows = []
    for _ in range(n):
        kw = {}
        if rng.random() < 0.5:
            kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))}
        if rng.random() < 0.4:
            kw["min_tokens"] = rng.randrange(0, 6)
        if rng.random() < 0.3:
            kw["allowed_token_ids"] = rng.sample(range(V + 5), rng.randrange(1, 20))  # some outside V
        if rng.random() < 0.4:
            kw["bad_words_token_ids"] = [[rng.randrange(8) for _ in range(rng.randrange(1, 3))]
                                         for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.5:
            kw.update(repetition_penalty=rng.choice([1.0, 1.3]), frequency_penalty=rng.choice([0.0, 0.5]),
                      presence_penalty=rng.choice([0.0, -0.4]))
        outputs = [rng.randrange(8) for _ in range(rng.randrange(0, 8))]  # small ids: bad words match
        rows.append(LogitsRows(SamplingParams(**kw), {rng.randrange(V) for _ in range(rng.randrange(0, 3))},
                               [rng.randrange(V) for _ in range(rng.randrange(1, 6))], outputs,
                               [rng.randrange(8) for _ in range(rng.randrange(0, 3))]))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_batched_processors_are_the_per_request_loop_bit_for_bit(seed):
    rng, V = random.Random(seed), 40
    rows = random_rows(rng, V, 12)
    logits = torch.randn(sum(r.num_rows for r in rows), V, generator=torch.Generator().manual_seed(seed)) * 4
    want = logits.clone()
    old_apply_logits_processors(want, rows)
    apply_logits_processors(logits, rows)
    assert torch.equal(logits, want)
    assert any(r.params.logit_bias for r in rows) and any(r.params.has_token_masks for r in rows)


def test_a_bias_outside_the_vocabulary_raises_as_before():
    logits = torch.zeros(2, 10)
    with pytest.raises(IndexError):
        apply_logits_processors(logits, [LogitsRows(SamplingParams(logit_bias={3: 1.0}), set(), [1], [], []),
                                         LogitsRows(SamplingParams(logit_bias={12: 1.0}), set(), [1], [], [])])


END = [7, 8]  # a two-token end of thinking, forced one token at a time


@pytest.mark.parametrize("seen,budget,forced", [
    ([], 0, 7),                      # no thinking allowed: the end right away
    ([1, 2], 3, None),               # under the budget
    ([1, 2, 3], 3, 7),               # budget spent: the end's first token
    ([1, 2, 3, 7], 3, 8),            # ... then its second
    ([1, 2, 3, 7, 8], 3, None),      # thinking over: nothing forced after it
    ([1, 2, 7], 3, None),            # the model began the end itself inside the budget
    ([7, 8, 4, 5, 6, 9], 1, None),   # the end came early; the answer is unbounded
    ([1, 7, 2, 3], 3, 7),            # a lone 7 is not the end
])
def test_thinking_token_budget_forces_the_end_of_thinking(seen, budget, forced):
    from moeserve.sample.processors import forced_end_of_thinking
    p = SamplingParams(thinking_token_budget=budget, thinking_end_token_ids=END)
    assert forced_end_of_thinking(p, seen) == forced


def test_thinking_budget_rows_keep_only_the_forced_token_mtp_drafts_included():
    """Row j follows the drafts before it; a forced row keeps the forced token alone, also where
    allowed_token_ids would exclude it (the budget wins, as in vLLM)."""
    V = 16
    p = SamplingParams(thinking_token_budget=2, thinking_end_token_ids=END, allowed_token_ids=[3, 4])
    logits = torch.randn(3, V)
    raw = logits.clone()
    apply_logits_processors(logits, [LogitsRows(p, set(), [1], [5], [6, 7])])  # rows after [5], [5,6], [5,6,7]
    assert torch.isinf(logits[0, [0, 1, 2, 5, 6, 7, 8]]).all() and torch.equal(logits[0, [3, 4]], raw[0, [3, 4]])
    for row, token in ((1, 7), (2, 8)):
        assert torch.isinf(logits[row]).sum() == V - 1 and logits[row, token] == raw[row, token], row
