"""--shared-expert-ranks at the dispatcher level, over 3 real gloo ranks (2 routed, 1 shared): routed + shared
rows in one dispatch give the single-process result, and the bytes each rank sends match the formula."""
import pytest
import torch

from moeserve.config import ParallelConfig
from moeserve.distributed import comm
from moeserve.distributed.parallel_state import destroy_distributed, get_ep_group, init_distributed
from moeserve.layers.mlp import DenseMLP
from moeserve.layers.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, Int8PayloadCodec, LocalDispatcher
from moeserve.layers.moe.layer import SharedExpertsAsSlot
from moeserve.layers.moe.placement import ExpertMap, LayerPlacement, default_map
from tests.distributed.test_dispatch import E, H, I, K, full_experts, local_experts
from tests.distributed.gloo import spawn_ranks

WORLD, SHARED = 3, 1
CASES = ("alltoall", "allgather", "alltoall-int8", "allgather-int8")
TOKENS = {0: 5, 1: 3, 2: 4}  # the shared rank has requests of its own too (attention is DP everywhere)


def shared_mlp() -> DenseMLP:
    torch.manual_seed(1)
    mlp = DenseMLP(H, I)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    return mlp


def placement_of(rank: int) -> LayerPlacement:
    return LayerPlacement(tuple(default_map(E, 0, WORLD - SHARED)), WORLD, rank, num_shared_ranks=SHARED)


def tokens(rank: int):
    g = torch.Generator().manual_seed(200 + rank)
    t = TOKENS[rank]
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, torch.rand(t, K, generator=g), ids


def pairs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical ids [T, K+1] with the shared column, weights [T, K+1]) as the MoE block builds them."""
    _, w, ids = tokens(rank)
    pl = placement_of(rank)
    phys = torch.cat([ExpertMap(pl).to_physical(ids), pl.shared_destinations(ids.shape[0], "cpu")], 1)
    return phys, torch.cat([w, torch.ones(w.shape[0], 1)], 1)


def run_case(rank: int, case: str):
    full, mlp = full_experts(), shared_mlp()
    x, w, ids = tokens(rank)
    int8 = case.endswith("-int8")
    codec = Int8PayloadCodec() if int8 else None
    with torch.no_grad():
        # the INT8 payload: routed and shared experts alike see the rows as the codec rounds them
        seen = codec.decode(codec.encode(x)) if int8 else x
        want = LocalDispatcher().combine(LocalDispatcher().dispatch(seen, w, ids), full) + mlp(seen)
        pl = placement_of(rank)
        compute = SharedExpertsAsSlot(mlp) if pl.holds_shared else local_experts(full, pl, 1, rank)
        d = (AllToAllDispatcher if case.startswith("alltoall") else AllGatherDispatcher)(get_ep_group(), pl, codec)
        phys, weights = pairs(rank)
        comm.STATS.reset()
        got = d.combine(d.dispatch(x, weights, phys), compute)
    return torch.allclose(got, want, atol=1e-4, rtol=1e-4), dict(comm.STATS.reset().bytes)


def rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    init_distributed(ParallelConfig(data_parallel_size=WORLD, enable_expert_parallel=True,
                                    shared_expert_ranks=SHARED), rank, f"tcp://127.0.0.1:{port}")
    try:
        for case in CASES:
            results[(case, rank)] = run_case(rank, case)
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(rank_main, WORLD)


@pytest.mark.parametrize("case", CASES)
def test_routed_and_shared_rows_in_one_dispatch_match_local(results, case):
    assert all(results[(case, r)][0] for r in range(WORLD))


def test_alltoall_bytes_match_the_formula(results):
    """Each rank sends the rows of its pairs addressed elsewhere (its shared-expert rows included, one per
    token, unless it is the shared rank) and sends back the outputs of the rows it received: H float32 each,
    plus one int32 slot per dispatched row."""
    row = H * 4
    dest = {r: placement_of(r).rank_of(pairs(r)[0].reshape(-1)) for r in range(WORLD)}
    for r in range(WORLD):
        sent = int((dest[r] != r).sum())
        returned = sum(int((dest[q] == r).sum()) for q in range(WORLD) if q != r)
        b = results[("alltoall", r)][1]
        assert b["alltoall"] == (sent + returned) * row, r
        assert b["alltoall_meta"] == sent * 4, r
    shared_rows = sum(TOKENS[q] for q in range(WORLD - SHARED))  # the routed ranks' tokens, one row each
    assert sum(int((dest[q] == WORLD - 1).sum()) for q in range(WORLD - SHARED)) == shared_rows


def test_allgather_bytes_match_the_formula(results):
    """All-gather of every rank's padded rows, K+1 weights and K+1 slot ids; reduce-scatter of the sums."""
    width = max(TOKENS.values())
    for r in range(WORLD):
        b = results[("allgather", r)][1]
        assert b["allgather"] == (WORLD - 1) * width * (H * 4 + (K + 1) * 4 + (K + 1) * 8)
        assert b["reduce_scatter"] == (WORLD - 1) * width * H * 4
