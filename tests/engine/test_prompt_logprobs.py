"""prompt_logprobs (vLLM's): every prompt token but the first scored by the model, as a whole-prompt forward
(engine.score) gives, under chunked prefill, preemption, MTP, and with the prefix cache (which such requests
skip: cached positions have no logits)."""
import pytest

from moeserve import LLM, SamplingParams

PROMPT = list(range(20, 61))


def _check(out, llm, prompt, n):
    ref = llm.engine.score(prompt).log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        assert plp[i][prompt[i]] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-5)
        best = ref[i - 1].topk(n).indices.tolist()
        assert set(best) <= set(plp[i]) and len(plp[i]) <= n + 1


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=16), dict(num_kv_blocks=8, block_size=8),
                                dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2})])
def test_prompt_logprobs_match_a_whole_prompt_forward(mtp_ckpt_dir, kw):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    prompts = [PROMPT, PROMPT[:7], [5]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for o, p in zip(outs, prompts):
        _check(o, llm, p, 3)
    plain = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    if "num_kv_blocks" in kw:
        assert llm.engine.stats().num_preemptions > 0  # entries were not counted twice on recompute


def test_prompt_logprobs_skip_the_prefix_cache(mtp_ckpt_dir):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", block_size=4)
    llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2))
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    _check(out, llm, PROMPT, 0)
    again = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens > 0
