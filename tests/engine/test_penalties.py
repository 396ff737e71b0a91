"""vLLM's repetition / frequency / presence penalties: the formula by hand, the batched implementation
against a per-row reference under hypothesis, greedy decoding against a hand loop over the model's own
logits, and MTP staying lossless with them."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve import LLM, SamplingParams
from moeserve.sample import LogitsRows, apply_logits_processors
from moeserve.sample import processors  # where apply_logits_processors finds the penalty code
from moeserve.sampling_params import SamplingParamsError

PROMPT = [5, 17, 99, 200, 3, 45, 67, 8, 9, 10]


def test_formula_by_hand_with_a_draft_row():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.tensor([[1.0, -1.0, 2.0, 4.0, -2.0, 3.0]] * 2)
    # prompt [0]; outputs [1, 1, 2]; row 1 samples after draft 3 (accepted if row 1 is used)
    apply_logits_processors(logits, [LogitsRows(params, set(), [0], [1, 1, 2], [3])])
    row0 = [1.0 / 2, -1.0 * 2 - 2 * 0.5 - 0.25, 2.0 / 2 - 0.5 - 0.25, 4.0, -2.0, 3.0]
    row1 = row0[:3] + [4.0 / 2 - 0.5 - 0.25, -2.0, 3.0]
    assert logits.tolist() == [pytest.approx(row0), pytest.approx(row1)]


def reference(logits: torch.Tensor, rows: list[LogitsRows]) -> torch.Tensor:
    """apply_logits_processors written the plain way: request by request, row by row, a dense count vector
    per row (row j counts the outputs and drafts 0..j-1), the penalties as Python scalars."""
    out, r = logits.clone(), 0
    for req in rows:
        p, n_out = req.params, len(req.output_ids)
        for j in range(req.num_rows):
            row = out[r + j]
            for t, b in p.logit_bias.items():
                row[t] += b
            if n_out + j < p.min_tokens:
                for t in req.stop_ids:
                    row[t] = float("-inf")
            if p.has_penalties:
                generated = req.output_ids + req.draft_ids[:j]
                counts = torch.zeros_like(row)
                for t in generated:
                    counts[t] += 1
                if p.repetition_penalty != 1.0:
                    seen = counts > 0
                    seen[req.prompt_ids] = True
                    rp = p.repetition_penalty
                    row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        r += req.num_rows
    return out


@st.composite
def steps(draw):
    """One step's rows: several requests, some without penalties, some with logit_bias / min_tokens, MTP
    drafts of different lengths, empty outputs, tokens repeated (a small vocabulary)."""
    V = draw(st.integers(2, 24))
    tok = st.integers(0, V - 1)
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        kw = {}
        if draw(st.booleans()):
            kw["repetition_penalty"] = draw(st.sampled_from([1.0, 0.5, 0.9, 1.3, 2.0, 7.5]))
            kw["frequency_penalty"] = draw(st.sampled_from([0.0, -2.0, -0.3, 0.1, 0.5, 2.0]))
            kw["presence_penalty"] = draw(st.sampled_from([0.0, -1.5, 0.25, 0.7, 2.0]))
        if draw(st.integers(0, 3)) == 0:
            kw["logit_bias"] = draw(st.dictionaries(tok, st.sampled_from([-100.0, -1.0, 0.5, 3.0]), max_size=3))
        stop_ids = set()
        if draw(st.integers(0, 3)) == 0:
            kw["min_tokens"] = draw(st.integers(1, 8))
            stop_ids = draw(st.sets(tok, min_size=1, max_size=2))
        rows.append(LogitsRows(SamplingParams(**kw), stop_ids, draw(st.lists(tok, min_size=1, max_size=12)),
                               draw(st.lists(tok, max_size=12)), draw(st.lists(tok, max_size=3))))
    R = sum(req.num_rows for req in rows)
    # values with ties, zeros and signs; the generator seed drawn so hypothesis can shrink it
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = (torch.randint(-6, 7, (R, V), generator=g).float() / 2
              + torch.randn(R, V, generator=g) * draw(st.sampled_from([0.0, 1.0, 30.0])))
    if draw(st.booleans()):  # a non-contiguous view of the same values
        logits = logits.t().contiguous().t()
    return logits, rows


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps())
def test_batched_penalties_equal_a_per_row_reference(step):
    logits, rows = step
    want = reference(logits, rows)
    apply_logits_processors(logits, rows)
    assert torch.equal(logits, want)  # bit for bit (-0.0 == 0.0; no NaN here)


def test_batched_penalties_on_a_full_vocabulary():
    """DeepSeek-V3's vocabulary, 200 outputs per request, drafts 0..3: the flat indices span many rows."""
    V, g = 129280, torch.Generator().manual_seed(1)
    rows = [LogitsRows(SamplingParams(repetition_penalty=1.0 + 0.1 * i, frequency_penalty=0.3 * (i % 3),
                                      presence_penalty=0.2 * (i % 2)), set(),
                       torch.randint(0, V, (300,), generator=g).tolist(),
                       torch.randint(0, 3000, (200,), generator=g).tolist(),
                       torch.randint(0, 3000, (i % 4,), generator=g).tolist()) for i in range(6)]
    rows.insert(3, LogitsRows(SamplingParams(), set(), [5, 6], [5, 5, 7], [8]))  # no penalties
    logits = torch.randn(sum(r.num_rows for r in rows), V, generator=g) * 5
    want = reference(logits, rows)
    apply_logits_processors(logits, rows)
    assert torch.equal(logits, want)


def test_requests_without_penalties_cost_nothing(monkeypatch):
    """A step where no request has penalties never reaches the penalty code; with penalised requests
    beside them, their rows stay bit for bit as they were."""
    calls = []
    monkeypatch.setattr(processors, "_apply_penalties", lambda *a: calls.append(a))
    logits = torch.randn(3, 10)
    apply_logits_processors(logits, [LogitsRows(SamplingParams(logit_bias={2: 1.0}), set(), [1], [3, 3], []),
                                     LogitsRows(SamplingParams(min_tokens=4), {0}, [1], [], [4])])
    assert calls == []
    monkeypatch.undo()
    before = torch.randn(4, 10)
    logits = before.clone()
    apply_logits_processors(logits, [LogitsRows(SamplingParams(), set(), [1, 2], [3, 3], [4]),
                                     LogitsRows(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),
                                                set(), [1, 2], [3, 3], [4])])
    assert torch.equal(logits[:2], before[:2])
    assert not torch.equal(logits[2:], before[2:])


def test_penalties_are_validated():
    for kw, name in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                     ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "x"}, "repetition_penalty")]:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert e.value.param == name


def _by_hand(llm: LLM, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy over the engine's own logits of the whole sequence, penalties applied here."""
    out: list[int] = []
    for _ in range(n):
        logits = llm.engine.score(prompt + out)[-1].clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).to(logits.dtype) \
            if out else torch.zeros_like(logits)
        seen = counts > 0
        seen[prompt] = True
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def llm(mtp_ckpt_dir):
    return LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False)


PENALTIES = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=0.7)]


@pytest.mark.parametrize("kw", PENALTIES)
def test_greedy_with_penalties_matches_a_hand_loop(llm, kw):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw)
    got = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids
    assert got == _by_hand(llm, PROMPT, 16, params)
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    assert got != plain  # the penalties changed something: the test sees them


def test_mtp_stays_lossless_with_penalties(mtp_ckpt_dir, llm):
    """Rows after a draft count that draft as generated. Mild penalties, so some (unpenalised) MTP drafts
    are still accepted and those rows are exercised."""
    prompts = [PROMPT, PROMPT[:4], list(range(20, 61)), [7, 8, 9, 10, 11], [42]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.05,
                            frequency_penalty=0.05)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))]
    assert want != plain
    spec = LLM(mtp_ckpt_dir("v3"), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.stats().spec_num_accepted_tokens > 0
