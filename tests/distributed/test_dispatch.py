"""Dispatchers over real gloo process groups (2 ranks) against LocalDispatcher, plus their byte counts."""
import pytest
import torch

from moeserve.config import ParallelConfig
from moeserve.distributed import comm
from moeserve.distributed.parallel_state import destroy_distributed, get_ep_group, init_distributed
from moeserve.layers.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, LocalDispatcher
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.moe.placement import ExpertMap, LayerPlacement, default_map
from tests.distributed.gloo import spawn_ranks

E, H, I, K = 8, 16, 8, 2
TOKENS = {0: 5, 1: 0}  # rank 1 has no tokens at all: it still joins every collective


def full_experts() -> FusedExperts:
    torch.manual_seed(0)
    ex = FusedExperts(E, H, I)
    with torch.no_grad():
        ex.w13.normal_()
        ex.w2.normal_()
    return ex


def local_experts(full: FusedExperts, placement: LayerPlacement, shards: int, rank: int) -> FusedExperts:
    ex = FusedExperts(placement.slots_per_rank, H, I, placement.local_slot_experts(), rank, shards)
    i = ex.intermediate
    with torch.no_grad():
        for s, e in enumerate(ex.slot_experts):
            ex.w13[s, :i] = ex.shard("gate_proj", full.w13[e, :I])
            ex.w13[s, i:] = ex.shard("up_proj", full.w13[e, I:])
            ex.w2[s] = ex.shard("down_proj", full.w2[e])
    return ex


def tokens(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    t = TOKENS[rank]
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.long)
    return x, torch.rand(t, K, generator=g), ids


CASES = ("alltoall", "alltoall_redundant", "allgather", "allgather_tp_sharded")


def run_case(rank: int, case: str):
    ep, full = get_ep_group(), full_experts()
    x, w, ids = tokens(rank)
    want = LocalDispatcher().combine(LocalDispatcher().dispatch(x, w, ids), full)
    redundant = 2 if case == "alltoall_redundant" else 0
    if case == "allgather_tp_sharded":
        placement, shards = LayerPlacement(tuple(range(E)), 2, rank, experts_tp_sharded=True), 2
    else:
        placement, shards = LayerPlacement(tuple(default_map(E, redundant, 2)), 2, rank), 1
    experts = local_experts(full, placement, shards, rank)
    phys = ExpertMap(placement).to_physical(ids)
    cls = AllToAllDispatcher if case.startswith("alltoall") else AllGatherDispatcher
    d = cls(ep, placement)
    comm.STATS.reset()
    got = d.combine(d.dispatch(x, w, phys), experts)
    stats = comm.STATS.reset()
    remote = int(((phys // placement.slots_per_rank) != rank).sum())
    return torch.allclose(got, want, atol=1e-5, rtol=1e-5), stats.bytes, remote


def rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    init_distributed(ParallelConfig(data_parallel_size=2, enable_expert_parallel=True), rank,
                     f"tcp://127.0.0.1:{port}")
    try:
        for case in CASES:
            results[(case, rank)] = run_case(rank, case)
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(rank_main, 2)


@pytest.mark.parametrize("case", CASES)
def test_distributed_dispatch_matches_local(results, case):
    assert results[(case, 0)][0] and results[(case, 1)][0]


def test_alltoall_counts_bytes(results):
    (_, b0, remote0), (_, b1, remote1) = results[("alltoall", 0)], results[("alltoall", 1)]
    row = H * 4  # float32 rows
    assert remote0 > 0 and remote1 == 0  # rank 1 has no tokens
    # Rank 0 sends its remote pairs' rows and receives them back; rank 1 returns what it received.
    assert b0["alltoall"] == remote0 * row and b1["alltoall"] == remote0 * row
    assert b0["alltoall_meta"] == remote0 * 4  # the int32 slot of each row


@pytest.mark.parametrize("case", ["allgather", "allgather_tp_sharded"])
def test_allgather_counts_bytes(results, case):
    width = max(TOKENS.values())  # every rank pads to the widest
    for rank in (0, 1):
        b = results[(case, rank)][1]
        assert b["allgather"] == width * (H * 4 + K * 4 + K * 8)  # rows + weights + slot ids to one peer
        assert b["reduce_scatter"] == 2 * width * H * 4 // 2


def test_replicated_expert_pairs_alternate_over_replicas():
    placement = LayerPlacement(tuple(default_map(E, 2, 2)), 2, 0)  # rank r copies two of rank r+1's experts
    replicated = [e for e in range(E) if placement.phys_to_logical.count(e) == 2]
    assert len(replicated) == 2
    e = replicated[0]
    phys = ExpertMap(placement).to_physical(torch.full((6, 1), e))
    slots = [s for s, x in enumerate(placement.phys_to_logical) if x == e]
    assert phys.view(-1).tolist() == [slots[0], slots[1]] * 3
    assert sorted({s // placement.slots_per_rank for s in slots}) == [0, 1]  # replicas on both ranks
