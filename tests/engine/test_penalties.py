"""vLLM's repetition / frequency / presence penalties: the formula by hand, greedy decoding against a hand
loop over the model's own logits, and MTP staying lossless with them."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.layers.sampler import LogitsRows, apply_logits_processors
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
