import math

import pytest

from moeserve.perf import comm
from moeserve.perf.hardware import load_hardware
from tests.planner.helpers import TOY_HW as HW

# hardware.md: DeepEP low-latency on H800 + 400G IB, 128 tokens x top-8, FP8 dispatch / BF16 combine.
DEEPEP = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369)}


@pytest.mark.parametrize("ep", sorted(DEEPEP))
def test_alltoall_reproduces_deepep(ep):
    """Each collective with its own kind's floor (moe.py passes "dispatch" / "combine"): the combine used to be
    checked against the dispatch floor, which passed at 15% only by chance (EP128 332 us against 369).
    Dispatch is exact at EP 8/16/128 and within 3% at 32/64 (the running maximum of the floors keeps EP16's
    38.3 us floor where EP32's and EP64's own are lower); combine is exact."""
    hw = load_hardware("h800")
    copies = 128 * 8
    dispatch = comm.alltoall(hw, ep, copies, 7168 + 7168 / 128 * 4, "dispatch") * 1e6
    combine = comm.alltoall(hw, ep, copies, 7168 * 2, "combine") * 1e6
    d, c = DEEPEP[ep]
    assert dispatch == pytest.approx(d, rel=0.03)
    assert combine == pytest.approx(c, rel=0.005)


def test_cann_alltoall_at_the_cloudmatrix_operating_point_hand_case():
    """Issue 41: is the CloudMatrix decode row too slow from its dispatch / combine term? At 128 tokens per die
    the term returns CANN Table 7 (test_terms.py test_dispatch_combine_reproduce_their_tables); at the row's
    operating point (batch 76 per die with one MTP draft = 152 tokens per die, 144 ranks), by hand:
    dispatch = floor 107.57 us (EP128's 152 - its payload 128 x 8 x 7172 B x 127/128 at 164 GB/s)
               + 152 x 8 x 7172 B x 143/144 / (196 x 0.837 GB/s);
    combine  = floor 61.89 us (EP64's 150 - 128 x 8 x 14336 B x 63/64 at 164 GB/s, held at EP128)
               + 152 x 8 x 14336 B x 143/144 / (196 x 0.837 GB/s)."""
    hw = load_hardware("cloudmatrix-384-die")
    bw = 196e9 * 0.837
    d_floor = 152 - 128 * 8 * 7172 * (127 / 128) / 164e9 * 1e6
    c_floor = 150 - 128 * 8 * 14336 * (63 / 64) / 164e9 * 1e6
    d = d_floor + 152 * 8 * 7172 * (143 / 144) / bw * 1e6
    c = c_floor + 152 * 8 * 14336 * (143 / 144) / bw * 1e6
    assert comm.alltoall(hw, 144, 152 * 8, 7172, "dispatch") * 1e6 == pytest.approx(d, rel=1e-3)
    assert comm.alltoall(hw, 144, 152 * 8, 14336, "combine") * 1e6 == pytest.approx(c, rel=1e-3)
    assert d == pytest.approx(160.4, abs=0.2) and c == pytest.approx(167.4, abs=0.2)


def test_link_time_hand_case():
    # 1 GB over scale-up at 100 GB/s x 0.5 = 20 ms; 0.1 GB out at 10 x 0.5 = 20 ms; + 10 us
    assert comm.link_time(HW, 1e9, 0.1e9) == pytest.approx(0.02001)


def test_allgather_hierarchical_hand_case():
    # 16 ranks, domain 8, 1.6 GB total: in-domain 1.6e9 * 7/8 = 1.4 GB -> 28 ms;
    # out 1.6e9 * 8 / (16 * 8) = 0.1 GB -> 20 ms. Two nodes: one round, so the phases add (the scale-out
    # fetch feeds the in-domain share); ring hops: 7 inside + 1 outside at 10 us
    assert comm.allgather(HW, 16, 1.6e9) == pytest.approx(0.028 + 0.020 + 8e-5)
    # 32 ranks = 4 nodes: 3 rounds, the shorter phase hides but for one round. in 1.4 GB -> 28 ms; out
    # 1.6e9 * 24 / (32 * 8) = 0.15 GB -> 30 ms: 30 + 28 / 3 ms, hops 7 + 3
    assert comm.allgather(HW, 32, 1.6e9) == pytest.approx(0.030 + 0.028 / 3 + 1e-4)
    # inside one domain: 7/8 of the data, 7 ring hops
    assert comm.allgather(HW, 8, 0.8e9) == pytest.approx(0.7e9 / 50e9 + 7e-5)
    assert comm.allreduce(HW, 8, 0.8e9) == pytest.approx(2 * comm.allgather(HW, 8, 0.8e9))
    assert comm.allgather(HW, 1, 1e9) == 0.0


def test_alltoall_fractions():
    assert comm.domain_fractions(HW, 32) == (7 / 32, 24 / 32)
    # 1000 copies x 1000 B, 7/32 over scale-up (50 GB/s), 24/32 over scale-out (5 GB/s)
    assert comm.alltoall(HW, 32, 1000, 1000) == pytest.approx(0.75e6 / 5e9 + 1e-5)


def test_max_load_factor():
    assert comm.max_load_factor(8.0, round(math.e ** 4)) == pytest.approx(1 + math.sqrt(
        2 * math.log(round(math.e ** 4)) / 8))
    assert comm.max_load_factor(0, 10) == 1.0 and comm.max_load_factor(5, 1) == 1.0
    assert comm.max_load_factor(1e6, 128) < 1.01  # noise vanishes at large loads


def test_kv_pull_hand_case():
    # 0.1 GB over the NIC at 10 GB/s x 0.5 = 20 ms, or over scale-up at 100 x 0.5 = 2 ms; + 10 us
    assert comm.kv_pull(HW, 0.1e9, in_domain=False) == pytest.approx(0.02001)
    assert comm.kv_pull(HW, 0.1e9, in_domain=True) == pytest.approx(0.00201)
    assert comm.kv_pull(HW, 0.0, in_domain=False) == 0.0
