"""--enable-dbo (dual-batch overlap): each step runs as two interleaved micro-batches; the tokens are those of
the plain engine, single process and over DP ranks with EP (alltoall, allgather, INT8 dispatch, MTP), idle
ranks included."""
import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def reference(mtp_ckpt_dir):
    return tokens(LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=16))


def test_single_process(mtp_ckpt_dir, reference):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=16, enable_dbo=True)
    assert tokens(llm) == reference
    assert tokens(llm, PROMPTS[1:2]) == reference[1:2]  # one request: the second micro-batch is empty


@pytest.mark.parametrize("kw", [
    dict(),  # alltoall
    dict(moe_comm="allgather", moe_comm_dtype="int8"),
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
], ids=["alltoall", "allgather-int8", "mtp"])
def test_dp2_ep(mtp_ckpt_dir, reference, kw):
    if kw.get("moe_comm_dtype") == "int8" or "speculative_config" in kw:  # their own reference
        ref = tokens(LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=16, data_parallel_size=2,
                         enable_expert_parallel=True, distributed_timeout=30, **kw))
    else:
        ref = reference
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=16, data_parallel_size=2,
              enable_expert_parallel=True, enable_dbo=True, distributed_timeout=30, **kw)
    try:
        assert tokens(llm) == ref
        assert tokens(llm, PROMPTS[1:2]) == ref[1:2]  # the other rank idles: dummy steps in two micro-batches
    finally:
        llm.shutdown()


def test_refused_with_tensor_parallel(mtp_ckpt_dir):
    with pytest.raises(ConfigError, match="--enable-dbo"):
        LLM(mtp_ckpt_dir("v3"), dtype="float32", tensor_parallel_size=2, enable_dbo=True)
