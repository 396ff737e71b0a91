"""DeepSeek FP8 checkpoints under DP/EP/TP: each rank keeps its FP8 slice (block-aligned) or re-quantizes
an unaligned slice (the tiny model's dims are below 128); greedy tokens match the single-process FP8 engine."""
import pytest

from moeserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("layout", [
    dict(data_parallel_size=2),  # experts TP-sharded over both ranks
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
], ids=["dp2-tp-sharded-experts", "dp2-tp2-ep"])
def test_fp8_layouts_match_single_process(fp8_path, layout):
    want = tokens(LLM(fp8_path, dtype="float32"))
    llm = LLM(fp8_path, dtype="float32", distributed_timeout=60, **layout)
    try:
        assert llm.config.quant.method == "fp8"
        assert tokens(llm) == want
    finally:
        llm.shutdown()
