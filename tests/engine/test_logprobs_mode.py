"""--logprobs-mode (vLLM's four modes) against the model's own logits, taken by a whole-sequence forward
(engine.score) of the prompt and the tokens the request produced: raw_* report those logits (their log_softmax
for *_logprobs); processed_* the logits the token was drawn from (logit_bias added, divided by the temperature,
top-k masked to -inf); prompt logprobs are raw in every mode (no processor applies to the prompt), values for
*_logits."""
import math

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import LOGPROBS_MODES

PROMPT = list(range(20, 41))
BIAS_TOKEN, BIAS, TEMPERATURE, TOP_K = 7, 3.0, 0.7, 3


@pytest.fixture(scope="module", params=LOGPROBS_MODES)
def llm(request, ckpt_dir):
    return LLM(ckpt_dir("v3"), dtype="float32", max_model_len=128, logprobs_mode=request.param)


def _model_rows(llm, out) -> torch.Tensor:
    """The model's logits [T, V] for each output token (row j scored output token j)."""
    logits = llm.engine.score(PROMPT + out.token_ids[:-1])
    return logits[len(PROMPT) - 1:]


def _processed(rows: torch.Tensor) -> torch.Tensor:
    """What the sampled request draws from, computed here from the model's logits."""
    x = rows.clone()
    x[:, BIAS_TOKEN] += BIAS
    x = x / TEMPERATURE
    kth = x.topk(TOP_K, dim=-1).values[:, -1:]
    return x.masked_fill(x < kth, -math.inf)


def _expected(mode: str, rows: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    values = processed if mode.startswith("processed") else rows
    return values if mode.endswith("logits") else values.log_softmax(-1)


def _check_entries(entries: list[dict], tokens: list[int], want: torch.Tensor, n: int) -> None:
    assert len(entries) == len(tokens)
    for j, (tok, entry) in enumerate(zip(tokens, entries)):
        assert entry[tok] == pytest.approx(float(want[j, tok]), abs=1e-4)
        finite = {t: v for t, v in entry.items() if v != -math.inf}
        best = want[j].topk(min(n, int(torch.isfinite(want[j]).sum()))).indices.tolist()
        assert set(best) <= set(finite)  # the top entries are the expected ones
        for t, v in finite.items():
            assert v == pytest.approx(float(want[j, t]), abs=1e-4)
        assert len(entry) - len(finite) == sum(1 for t in entry if want[j, t] == -math.inf)


SAMPLED = dict(temperature=TEMPERATURE, top_k=TOP_K, logit_bias={BIAS_TOKEN: BIAS}, max_tokens=6, ignore_eos=True,
               logprobs=5)


def test_sampled_logprobs_follow_the_mode(llm):
    # beside a greedy request and one without logprobs in the same steps: each row reads its own values
    params = [SamplingParams(seed=3, **SAMPLED), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(**SAMPLED)]
    outs = llm.generate(prompt_token_ids=[PROMPT, PROMPT[:9], PROMPT], sampling_params=params)
    for i in (0, 2):
        _check_sampled(llm, llm.config.model.logprobs_mode, outs[i].outputs[0])


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_mtp_drafts_report_the_mode(mtp_ckpt_dir, mode):
    """With MTP each emitted token's entry comes from the row it was accepted or drawn at."""
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", max_model_len=128, logprobs_mode=mode,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(seed=5, **SAMPLED))[0].outputs[0]
    _check_sampled(llm, mode, out)


def _check_sampled(llm, mode: str, out) -> None:
    rows = _model_rows(llm, out)
    processed = _processed(rows)
    _check_entries(out.logprobs, out.token_ids, _expected(mode, rows, processed), 5)
    if mode.startswith("processed"):  # top_k 3 of 5 asked: two masked entries, reported as -inf (vLLM's)
        assert all(sum(v == -math.inf for v in e.values()) >= 2 for e in out.logprobs)
    if mode == "processed_logprobs":  # a distribution over the top-k tokens alone
        assert all(math.fsum(math.exp(v) for v in e.values()) == pytest.approx(1.0, abs=1e-4)
                   for e in out.logprobs if len(e) == 5)


def test_greedy_without_processors_reports_the_raw_values(llm):
    """A greedy request without processors draws from the model's logits as they are: processed == raw."""
    mode = llm.config.model.logprobs_mode
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    res = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    out = res.outputs[0]
    rows = _model_rows(llm, out)
    _check_entries(out.logprobs, out.token_ids, _expected(mode, rows, rows), 3)
    # prompt logprobs: the model's logits of the prompt in every mode (log_softmax unless *_logits)
    prompt_rows = llm.engine.score(PROMPT)
    want = prompt_rows if mode.endswith("logits") else prompt_rows.log_softmax(-1)
    assert res.prompt_logprobs[0] is None
    _check_entries(res.prompt_logprobs[1:], PROMPT[1:], want[:-1], 2)


def test_an_unknown_mode_is_refused(ckpt_dir):
    with pytest.raises(ValueError, match="--logprobs-mode must be one of"):
        LLM(ckpt_dir("v3"), dtype="float32", logprobs_mode="processed")
