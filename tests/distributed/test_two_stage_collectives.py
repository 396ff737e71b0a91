"""--moe-comm-hierarchy two-stage: the MoE all-gather / reduce-scatter across nodes then inside them. Four gloo
ranks grouped as 2 simulated nodes x 2 (--ranks-per-node 2): the dispatcher gives the flat schedule's result,
its bytes per link class match the formula (inter-node: 1/L of the flat schedule's), and the engine's greedy
tokens equal one process's."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError, ParallelConfig
from moeserve.distributed import comm
from moeserve.distributed.parallel_state import (destroy_distributed, get_ep_group, get_ep_hierarchy,
                                                 init_distributed)
from moeserve.layers.moe.dispatch import AllGatherDispatcher, LocalDispatcher, make_dispatcher
from moeserve.layers.moe.placement import ExpertMap, LayerPlacement, default_map
from moeserve.perf.comm import hier_gather_bytes
from tests.distributed.test_dispatch import E, H, K, full_experts, local_experts
from tests.distributed.gloo import greedy_tokens, spawn_ranks

WORLD, NODE = 4, 2
TOKENS = {0: 5, 1: 0, 2: 3, 3: 4}  # rank 1 has no tokens: it still joins every collective
LAYOUT = dict(data_parallel_size=WORLD, enable_expert_parallel=True, moe_comm="allgather",
              moe_comm_hierarchy="two-stage", moe_node_size=NODE)


def tokens(rank: int):
    g = torch.Generator().manual_seed(300 + rank)
    t = TOKENS[rank]
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    return x, torch.rand(t, K, generator=g), ids


def run_case(rank: int):
    full = full_experts()
    x, w, ids = tokens(rank)
    placement = LayerPlacement(tuple(default_map(E, 0, WORLD)), WORLD, rank)
    experts = local_experts(full, placement, 1, rank)
    phys = ExpertMap(placement).to_physical(ids)
    want = LocalDispatcher().combine(LocalDispatcher().dispatch(x, w, ids), full)
    out = {}
    for name, d in (("flat", AllGatherDispatcher(get_ep_group(), placement, None, NODE)),
                    ("two-stage", make_dispatcher("allgather", get_ep_group(), placement, None, NODE,
                                                  get_ep_hierarchy()))):
        comm.STATS.reset()
        got = d.combine(d.dispatch(x, w, phys), experts)
        out[name] = (torch.allclose(got, want, atol=1e-5, rtol=1e-5), dict(comm.STATS.reset().bytes),
                     type(d).__name__)
    return out


def rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    init_distributed(ParallelConfig(**LAYOUT), rank, f"tcp://127.0.0.1:{port}")
    try:
        results[rank] = run_case(rank)
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(rank_main, WORLD)


def test_two_stage_gives_the_flat_result(results):
    for rank in range(WORLD):
        assert results[rank]["two-stage"][2] == "TwoStageAllGatherDispatcher"
        assert results[rank]["flat"][0] and results[rank]["two-stage"][0]


def test_bytes_per_link_class_match_the_formula(results):
    """Per rank, n = width x (H floats + K weights + K slot ids), m = width x H floats of partial sums:
    flat      intra (L-1) n + (L-1)/W x W m,  inter (W-L) n + (W-L)/W x W m;
    two-stage intra (L-1) M n + (L-1) M m,    inter (M-1) n + (M-1) m   (M = W / L nodes)."""
    width, nodes = max(TOKENS.values()), WORLD // NODE
    n, m = width * (H * 4 + K * 4 + K * 8), width * H * 4
    for rank in range(WORLD):
        flat, two = results[rank]["flat"][1], results[rank]["two-stage"][1]
        assert flat["moe_intra_node"] == (NODE - 1) * (n + m)
        assert flat["moe_inter_node"] == (WORLD - NODE) * (n + m)
        assert two["moe_intra_node"] == (NODE - 1) * nodes * (n + m)
        assert two["moe_inter_node"] == (nodes - 1) * (n + m)
        assert two["moe_inter_node"] * NODE == flat["moe_inter_node"]  # each byte crosses nodes once
        # the same total either way; the collectives' own counters agree with the link classes
        assert flat["moe_intra_node"] + flat["moe_inter_node"] == two["moe_intra_node"] + two["moe_inter_node"]
        assert two["allgather"] + two["reduce_scatter"] == two["moe_intra_node"] + two["moe_inter_node"]
        # the planner prices the allgather MoE layer with the same per-link-class bytes
        gather, scatter = hier_gather_bytes(WORLD, NODE, WORLD * n), hier_gather_bytes(WORLD, NODE, WORLD * m)
        assert (two["moe_intra_node"], two["moe_inter_node"]) == tuple(g + r for g, r in zip(gather, scatter))


PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def generate(llm):
    return greedy_tokens(llm, PROMPTS, GREEDY)


@pytest.mark.parametrize("extra", [dict(), dict(enable_dbo=True), dict(shared_expert_ranks=1, data_parallel_size=4,
                                                                          num_redundant_experts=1)],
                         ids=["plain", "dbo", "shared-expert-rank"])
def test_engine_two_stage_matches_single_process(ckpt_dir, extra):
    path = ckpt_dir("v3")
    want = generate(LLM(path, dtype="float32"))
    assert generate(LLM(path, dtype="float32", distributed_timeout=30, **{**LAYOUT, **extra})) == want


def test_engine_two_stage_a8w8_and_mtp_match_single_process(mtp_ckpt_dir):
    path = mtp_ckpt_dir("v3")
    kw = dict(quantization="a8w8", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    want = generate(LLM(path, dtype="float32", **kw))
    assert generate(LLM(path, dtype="float32", distributed_timeout=30, **LAYOUT, **kw)) == want


@pytest.mark.parametrize("kwargs, message", [
    (dict(LAYOUT, moe_comm="alltoall"), "--moe-comm allgather"),
    (dict(LAYOUT, moe_node_size=4), "more than one node"),
    (dict(LAYOUT, moe_node_size=3), "--ranks-per-node 3 must divide"),
    (dict(LAYOUT, moe_comm_hierarchy="tree"), "--moe-comm-hierarchy must be one of"),
])
def test_bad_hierarchies_are_refused_naming_the_flag(ckpt_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(ckpt_dir("v3"), dtype="float32", **kwargs)
