"""Routed BF16 experts through zentorch's fused MoE (layers/moe/zen.py) against the grouped path, and the
weight-cache discipline that keeps it from computing with weights that are no longer there.

These run where zentorch's fused MoE is available (an AMD CPU with zentorch installed, as scripts/setup.sh
installs it there); elsewhere the module is skipped, and the experts run on the paths the other tests cover."""
import gc

import pytest
import torch

from moeserve.layers.linear import packed_copy_bytes
from moeserve.layers.moe import zen
from moeserve.layers.moe.experts import FusedExperts

pytestmark = pytest.mark.skipif(not zen.available(), reason="zentorch's fused MoE is not available here")


def _experts(num: int, hidden: int, inter: int, seed: int, scale: float = 0.1) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(num, hidden, inter).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * scale)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * scale)
    return ex


def _reference(ex: FusedExperts, x, ids, weights):
    """The grouped path (torch._grouped_mm, no zentorch) on a copy of the same weights, per token."""
    ref = FusedExperts(ex.num_local_experts, ex.w13.shape[-1], ex.intermediate).to(torch.bfloat16)
    ref.load_state_dict(ex.state_dict())
    with torch.no_grad():
        return ref.forward_topk(x, ids, weights)


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within BF16 rounding of different kernels: 2% of the output's scale (stale weights differ by ~100%)."""
    diff = (y.float() - ref.float()).abs().max().item()
    assert diff <= 0.02 * ref.float().abs().max().item(), diff


def _routing(t: int, k: int, num: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, 64 if num <= 8 else 256, generator=g).to(torch.bfloat16), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("t", [1, 5, 32, 300])
def test_fused_moe_matches_grouped_experts(t):
    ex = _experts(8, 64, 32, t)
    ex.process_weights_after_loading()
    assert ex.fused and ex.packed is None  # no oneDNN packs; zentorch's cache copies are counted:
    assert packed_copy_bytes(ex) == 2 * (ex.w13.nbytes + ex.w2.nbytes)
    x, ids, weights = _routing(t, 3, 8, t)
    with torch.no_grad():
        y = ex.forward_topk(x, ids, weights)
    _assert_close(y, _reference(ex, x, ids, weights))


def test_rows_of_other_ranks_are_zero_and_the_rest_match():
    """The row interface (all-to-all / all-gather dispatch): one expert per row, -1 = another rank's row."""
    ex = _experts(8, 64, 32, 3)
    ex.process_weights_after_loading()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (20,), generator=g)
    ids[0], ids[1] = -1, 2
    weights = torch.rand(20, generator=g)
    with torch.no_grad():
        y = ex(x, ids, weights)
        assert (y[ids == -1] == 0).all()
        mine = ids >= 0
        ref = _reference(ex, x[mine], ids[mine, None], weights[mine, None])
        _assert_close(y[mine], ref)
        assert ex(x, torch.full((20,), -1), weights).abs().sum() == 0


def test_weights_moved_in_place_are_used_after_process_weights():
    """zentorch keeps each expert's reordered weights by address: an EPLB move writes new weights at the same
    address and calls process_weights_after_loading, which must flush them (else the old ones are used)."""
    ex = _experts(8, 64, 32, 5)
    ex.process_weights_after_loading()
    x, ids, weights = _routing(16, 2, 8, 6)
    with torch.no_grad():
        before = ex.forward_topk(x, ids, weights)
        new = _experts(8, 64, 32, 7)
        ex.w13.copy_(new.w13)
        ex.w2.copy_(new.w2)
        ex.process_weights_after_loading()
        after = ex.forward_topk(x, ids, weights)
    assert not torch.allclose(before.float(), after.float(), atol=1e-2)
    _assert_close(after, _reference(ex, x, ids, weights))


def test_new_experts_where_freed_ones_were_use_their_own_weights():
    """Engines built and dropped one after another (tests, sleep / reload) reuse freed memory: every new set
    of experts must compute with its own weights, never the reordered copy of whatever was there before."""
    x, ids, weights = _routing(32, 2, 8, 8)
    for seed in range(6):
        ex = _experts(8, 64, 32, 100 + seed, scale=0.05 * (seed + 1))
        ex.process_weights_after_loading()
        with torch.no_grad():
            y = ex.forward_topk(x, ids, weights)
        _assert_close(y, _reference(ex, x, ids, weights))
        del ex
        gc.collect()


def test_one_opaque_op_in_a_full_graph():
    ex = _experts(8, 64, 32, 9)
    ex.process_weights_after_loading()
    x, ids, weights = _routing(4, 2, 8, 10)
    with torch.no_grad():
        compiled = torch.compile(lambda a, b, c: ex.forward_topk(a, b, c), fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x, ids, weights), ex.forward_topk(x, ids, weights))


def test_switched_off_keeps_the_oneDNN_packs(monkeypatch):
    ex = _experts(4, 64, 32, 11)
    ex.process_weights_after_loading(fused_kernels=False)
    assert not ex.fused
    ex.process_weights_after_loading()
    assert ex.fused and ex.packed is None
    float32 = FusedExperts(4, 64, 32)  # zentorch's kernel is for BF16 weights
    float32.process_weights_after_loading()
    assert not float32.fused


def test_no_rows_is_no_call(capfd):
    """A rank that receives no rows: an empty result, and zentorch is not called (it logs a null-pointer error
    on an empty input, and raises for k > 1)."""
    ex = _experts(8, 64, 32, 12)
    ex.process_weights_after_loading()
    empty = torch.zeros(0, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert ex.forward_topk(empty, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 64)
        assert ex.fused_rows(empty, torch.zeros(0, dtype=torch.long), torch.zeros(0)).shape == (0, 64)
    assert "Null pointer" not in capfd.readouterr().err
