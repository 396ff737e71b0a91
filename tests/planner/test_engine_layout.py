"""The planner prices the layouts the engine builds: for every small EP layout (with and without dedicated
shared-expert ranks and redundant slots) the planner's Instance and the engine's expert plan accept the same
ones, give each routed rank the same slots and leave the shared ranks none."""
import pytest

from moeserve.config import ConfigError, ParallelConfig
from moeserve.layers.moe.placement import build_plan
from moeserve.arch import DeepseekArch
from moeserve.perf.deploy import Instance, PlanError
from tests.checkpoints import BASE

ARCH = DeepseekArch.from_dict({**BASE, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                               "scoring_func": "sigmoid", "topk_method": "noaux_tc"})


def engine_slots(world: int, shared: int, redundant: int) -> list[int] | None:
    try:
        parallel = ParallelConfig(data_parallel_size=world, enable_expert_parallel=True,
                                  shared_expert_ranks=shared, num_redundant_experts=redundant)
        plans = [build_plan(parallel, ARCH, rank) for rank in range(world)]
    except ConfigError:
        return None
    layer = min(plans[0].layers)
    return [len(p.layer(layer).local_slot_experts()) for p in plans]


def planner_slots(world: int, shared: int, redundant: int) -> list[int] | None:
    try:
        inst = Instance(cards=world, shared_expert_ranks=shared, redundant_experts=redundant)
        per = inst.expert_slots(ARCH.n_routed_experts)
    except (PlanError, ValueError):
        return None
    return [per] * inst.ep + [0] * shared


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
def test_planner_and_engine_lay_out_experts_alike(world):
    for shared in range(world):
        for redundant in range(4):
            assert engine_slots(world, shared, redundant) == planner_slots(world, shared, redundant), \
                (world, shared, redundant)

