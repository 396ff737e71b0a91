"""vLLM's Python API additions: LLM keywords, reset_prefix_cache, get_metrics, sleep / wake_up, SamplingParams
bad_words / allowed_token_ids / detokenize / output_kind / extra_args, Logprob objects."""
from __future__ import annotations

import pytest

from moeserve import LLM, Logprob, SamplingParams
from moeserve.sampling_params import SamplingParamsError

PROMPT = [5, 17, 99, 200, 3, 45, 67] * 5


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20,
               enforce_eager=True, block_size=16)


def _greedy(llm, **kw):
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                                   ignore_eos=True, **kw))[0]


def test_keywords_reach_the_config(ckpt_dir, llm):
    assert llm.config.cache.kv_cache_memory == 4 << 20 and llm.config.model.enforce_eager
    small = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, gpu_memory_utilization=0.01)
    assert small.engine.num_kv_blocks > 0 and small.config.cache.gpu_memory_utilization == 0.01


def test_logprob_objects(llm):
    out = _greedy(llm, logprobs=2, prompt_logprobs=1)
    first = out.outputs[0].logprobs[0]
    chosen = out.outputs[0].token_ids[0]
    assert isinstance(first[chosen], Logprob) and first[chosen].rank == 1  # greedy: the best token
    assert first[chosen].logprob == float(first[chosen]) and isinstance(first[chosen].decoded_token, str)
    ranks = sorted(lp.rank for lp in first.values())
    assert ranks == [1, 2]
    assert out.prompt_logprobs[0] is None and all(isinstance(v, Logprob) for v in out.prompt_logprobs[1].values())


def test_reset_prefix_cache_and_metrics(llm):
    _greedy(llm)
    again = _greedy(llm)
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert _greedy(llm).num_cached_tokens == 0
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:generation_tokens"] >= 15 and metrics["vllm:prefix_cache_hits"] > 0
    assert metrics["vllm:num_requests_running"] == 0


def test_sleep_and_wake_up_keep_results(llm):
    before = _greedy(llm).outputs[0].token_ids
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert all(t.untyped_storage().nbytes() == 0 for t in llm.engine.runner.kv_tensors())  # memory given back
    with pytest.raises(ValueError, match="wake_up"):
        _greedy(llm)
    llm.wake_up()
    assert not llm.is_sleeping() and _greedy(llm).outputs[0].token_ids == before
    with pytest.raises(ValueError, match="level=2"):
        llm.sleep(level=2)


def test_sampling_params_additions(llm):
    base = _greedy(llm).outputs[0].token_ids
    only = _greedy(llm, allowed_token_ids=[base[1]]).outputs[0].token_ids
    assert set(only) == {base[1]}
    no_text = _greedy(llm, detokenize=False).outputs[0]
    assert no_text.text == "" and no_text.token_ids == base
    assert _greedy(llm, bad_words_token_ids=[[base[0]]]).outputs[0].token_ids[0] != base[0]
    assert _greedy(llm, output_kind=2).outputs[0].token_ids == base
    for bad, field in ((dict(extra_args={"x": 1}), "extra_args"), (dict(output_kind=1), "output_kind"),
                       (dict(detokenize=False, stop=["a"]), "stop"), (dict(allowed_token_ids=[]), "allowed_token_ids")):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**bad)
        assert e.value.param == field


def test_skip_tokenizer_init(ckpt_dir):
    llm = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    out = llm.generate(prompt_token_ids=[PROMPT[:8]], sampling_params=SamplingParams(max_tokens=3, temperature=0,
                                                                                     ignore_eos=True))[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 3
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["text"])
