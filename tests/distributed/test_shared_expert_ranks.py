"""--shared-expert-ranks N: the last N EP ranks hold only the shared experts, every token's shared-expert row
travels in the same dispatch as its routed rows (rank processes over gloo, float32), and the greedy tokens
are the single process's."""
import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def run(model, **kw):
    llm = LLM(model, dtype="float32", distributed_timeout=30, **kw)
    try:
        return tokens(llm), llm.engine.stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return ckpt_dir("v3")  # 8 routed experts top-2, 1 shared expert


@pytest.fixture(scope="module")
def reference(path):
    return tokens(LLM(path, dtype="float32"))


EP = dict(enable_expert_parallel=True)


@pytest.mark.parametrize("layout", [
    dict(data_parallel_size=3, shared_expert_ranks=1),  # alltoall, 4 experts on each of 2 routed ranks
    dict(data_parallel_size=4, shared_expert_ranks=1, num_redundant_experts=1),  # 9 slots over 3 routed ranks
    dict(data_parallel_size=4, shared_expert_ranks=2, moe_comm="allgather", enable_dbo=True),
], ids=["dp3-n1-alltoall", "dp4-n1-redundant", "dp4-n2-allgather-dbo"])
def test_shared_expert_ranks_match_single_process(path, reference, layout):
    got, _ = run(path, **EP, **layout)
    assert got == reference


def test_shared_expert_ranks_a8w8_and_mtp_match_single_process(mtp_ckpt_dir):
    """INT8 weights (the shared MLP quantizes its rows on the shared rank as it would locally) and MTP, whose
    layer's MoE block also sends its shared-expert rows to the shared rank."""
    model = mtp_ckpt_dir("v3")
    kw = dict(quantization="a8w8", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    want = tokens(LLM(model, dtype="float32", **kw))
    got, _ = run(model, data_parallel_size=3, shared_expert_ranks=1, **EP, **kw)
    assert got == want


def test_eplb_never_moves_routed_experts_onto_shared_ranks(path, reference):
    """Online EPLB rebalances over the routed ranks only: experts move, tokens stay, and the shared rank
    keeps receiving only shared-expert rows (a routed slot there would be misrouted and change tokens)."""
    got, stats = run(path, data_parallel_size=3, shared_expert_ranks=1, num_redundant_experts=2,
                     enable_eplb=True, eplb_step_interval=2, **EP)
    assert got == reference
    assert stats.eplb_rebalances >= 3 and stats.eplb_experts_moved > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_size=2, shared_expert_ranks=1), "--enable-expert-parallel"),
    (dict(data_parallel_size=2, shared_expert_ranks=2, **EP), "leaves no rank for the routed experts"),
    (dict(data_parallel_size=2, tensor_parallel_size=2, shared_expert_ranks=1, **EP), "--tensor-parallel-size"),
    (dict(data_parallel_size=4, shared_expert_ranks=1, **EP),
     r"besides --shared-expert-ranks 1.*--num-redundant-experts 1"),
    (dict(data_parallel_size=3, shared_expert_ranks=-1, **EP), "--shared-expert-ranks must be >= 0"),
])
def test_layouts_that_cannot_work_are_refused_naming_the_flag(path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(path, dtype="float32", **kwargs)


def test_plan_of_shared_expert_ranks_and_a_model_without_shared_experts(path):
    """The plan every rank derives: routed slots over the first ranks only, the shared rank holds none and
    is addressed as physical id P; a model without shared experts is refused naming the flag."""
    import dataclasses

    import torch

    from moeserve.config import ParallelConfig
    from moeserve.layers.moe.placement import build_plan
    from moeserve.arch import DeepseekArch

    arch = DeepseekArch.from_pretrained(path)
    parallel = ParallelConfig(data_parallel_size=4, shared_expert_ranks=1, num_redundant_experts=1, **EP)
    plans = [build_plan(parallel, arch, rank) for rank in range(4)]
    layer = min(plans[0].layers)
    held = [p.layer(layer).local_slot_experts() for p in plans]
    assert held == [[0, 1, 2], [3, 4, 5], [6, 7, 0], []]
    assert not plans[2].layer(layer).holds_shared and plans[3].layer(layer).holds_shared
    pl = plans[0].layer(layer)
    assert pl.rank_of(torch.tensor([0, 3, 8, 9])).tolist() == [0, 1, 2, 3]  # 9 = P: the shared rank
    assert pl.local_slot(torch.tensor([4, 8, 9])).tolist() == [1, 2, 0]
    with pytest.raises(ConfigError, match="--shared-expert-ranks 1: this model has no shared experts"):
        build_plan(parallel, dataclasses.replace(arch, n_shared_experts=0), 0)
