"""MTP under DP=2 with EP (rank processes over gloo) gives single-process MTP's tokens and drafts."""
import pytest

from moeserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def run(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("layout", [
    dict(data_parallel_size=2, enable_expert_parallel=True),  # alltoall
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
], ids=["dp2-ep", "dp2-tp2-ep"])
def test_mtp_under_dp_ep_equals_single_process(mtp_ckpt_dir, layout):
    path = mtp_ckpt_dir("v3")
    reference = run(LLM(path, dtype="float32", max_num_batched_tokens=16, speculative_config=SPEC))
    plain = run(LLM(path, dtype="float32"))
    assert reference == plain
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, distributed_timeout=30, speculative_config=SPEC,
              **layout)
    try:
        assert run(llm) == reference
        stats = llm.engine.stats()  # summed over the DP ranks
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        assert len(stats.spec_drafts_per_position) == 2
        # One request: the other DP rank runs empty steps, its k MTP passes included (or the MoE
        # collectives of the MTP layer would hang until --distributed-timeout).
        assert run(llm, [PROMPTS[1]]) == [reference[1]]
    finally:
        llm.shutdown()
