"""Prefill's dispatch / combine as DeepEP normal mode: once per destination node over RDMA at the measured
normal-mode rate, then NVLink fan-out (kernels.md; issue 41 stage 2)."""
import pytest

from moeserve.perf import comm, moe
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import HardwareDB, load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step

V3, LITE = load_model("deepseek-v3"), load_model("deepseek-v2-lite")
H = 7168
D_BYTES = H + 4 * 56                      # FP8 + one fp32 scale per 128 elements


def test_nodes_per_token_by_hand():
    # top-4 of 8 groups, 2 groups per node (EP32 on 4 nodes): a node is missed with C(6,4)/C(8,4) = 15/70
    assert moe.nodes_per_token(V3, 4) == pytest.approx(4 * (1 - 15 / 70))
    assert moe.nodes_per_token(V3, 2) == pytest.approx(2 * (1 - 1 / 70))
    assert moe.nodes_per_token(V3, 8) == pytest.approx(4.0)        # node-limited: at most 4 of 8
    assert moe.nodes_per_token(V3, 16) == pytest.approx(8 * (1 - (7 / 8) ** 8))  # each group on 2 nodes
    assert moe.nodes_per_token(LITE, 4) == pytest.approx(4 * (1 - 0.75 ** 6))  # no groups: uniform
    assert moe.nodes_per_token(V3, 1) == 1.0


def test_h800_ep32_prefill_dispatch_and_combine_by_hand():
    hw = load_hardware("hgx-h800")
    inst = Instance(cards=32, redundant_experts=32, quantization="fp8")
    tokens = 8192
    ops = moe.moe_comm(V3, hw, inst, tokens, tokens * 32, prefill=True)
    nodes = 4 * (1 - 15 / 70)
    copies, _ = moe.routed_load(V3, inst, tokens * 32)
    recv = copies * 32 * (1 - (31 / 32) ** 8) / 8           # one copy per card, not per expert
    lat = (1.2 + 1.9) * 1e-6
    for op, per_row, rate in ((ops[0], D_BYTES, 58e9), (ops[1], 2 * H, 57e9)):
        rdma = tokens * nodes * per_row / rate                 # kernels.md: EP32 58 / 57 GB/s
        nvl = recv * per_row / (160e9 * 0.969)
        assert op.seconds == pytest.approx(max(rdma, nvl) + lat)
    assert ops[0].seconds == pytest.approx(8192 * nodes * D_BYTES / 58e9 + lat)   # RDMA-bound here
    # decode keeps the low-latency kernels (floors from the measured table)
    ll = moe.moe_comm(V3, hw, inst, tokens, tokens * 32)
    assert ll[0].seconds > 2 * ops[0].seconds


def test_inside_one_domain_only_the_nvlink_part_runs():
    hw = load_hardware("gb200-nvl72")
    inst = Instance(cards=64, quantization="fp8")
    op = moe.moe_comm(V3, hw, inst, 4096, 4096 * 64, prefill=True)[0]
    copies, _ = moe.routed_load(V3, inst, 4096 * 64)
    recv = copies * 64 * (1 - (63 / 64) ** 8) / 8
    assert op.seconds == pytest.approx(recv * D_BYTES / (900e9 * 0.778) + 1.2e-6)


def test_rate_scales_with_the_nic_and_holds_beyond_the_table():
    h800, h20 = load_hardware("hgx-h800"), load_hardware("hgx-h20")
    assert comm.normal_rate(h20, 32, "dispatch") == pytest.approx(58e9 * 25 / 50)
    assert comm.normal_rate(h800, 256, "combine") == pytest.approx(50e9)   # EP64's beyond the table
    assert comm.normal_rate(h800, 12, "dispatch") == pytest.approx(43e9)   # EP16's below it
    assert comm.normal_rate(load_hardware("atlas-800i-a2"), 32, "dispatch") is None  # no figure: LL model


def test_where_normal_mode_applies():
    hw = load_hardware("hgx-h800")
    assert moe.normal_mode(hw, Instance(cards=32), True)
    assert not moe.normal_mode(hw, Instance(cards=32), False)
    assert not moe.normal_mode(hw, Instance(cards=32, moe_comm="allgather"), True)
    assert not moe.normal_mode(hw, Instance(cards=36, shared_expert_ranks=4), True)
    assert not moe.normal_mode(load_hardware("cloudmatrix-384-die"), Instance(cards=32), True)


def test_two_batch_overlap_gives_the_normal_kernels_their_sms():
    """DeepEP's normal kernels hold 24 of 132 SMs: compute beside them runs on the rest, C + s X per half
    (the gain bound lifted so the mechanism shows); the kernel profile overlaps as deep as the roofline."""
    from dataclasses import replace
    from moeserve.perf.hardware import TERMS
    from moeserve.planner.explain import with_terms
    h800 = load_hardware("hgx-h800")
    hw = replace(h800, eff=replace(h800.eff, tbo_gain=(), tbo_max_gain=10.0))
    inst = Instance(cards=32, redundant_experts=32, quantization="fp8", micro_batch_overlap=True)
    half = prefill_step(V3, hw, Instance(cards=32, redundant_experts=32, quantization="fp8"), 1, 4096)
    c, x, s = half.seconds("compute"), half.seconds("comm"), 0.182
    fill = min(c, x) / V3.num_hidden_layers
    st = prefill_step(V3, hw, inst, 2, 4096)
    assert st.total - st.overhead == pytest.approx(2 * max(c + s * x, x) + fill)
    free = prefill_step(V3, with_terms(hw, [t for t in TERMS if t != "overlap_bound"]), inst, 2, 4096)
    assert free.total - free.overhead == pytest.approx(2 * max(c, x) + fill)
    dec = decode_step(V3, hw, inst, 64, 2048)                  # low-latency kernels: no SM share
    hdec = decode_step(V3, hw, Instance(cards=32, redundant_experts=32, quantization="fp8",
                                        overlap_shared=False), 32, 2048)
    cd, xd = hdec.seconds("compute"), hdec.seconds("comm")
    assert dec.total - dec.overhead == pytest.approx(2 * max(cd, xd) + min(cd, xd) / V3.num_hidden_layers)


def test_more_scale_out_never_slower_and_more_imbalance_never_faster():
    hw = load_hardware("hgx-h100")
    inst = Instance(cards=64, redundant_experts=64, quantization="fp8")
    base = prefill_step(V3, hw, inst, 2, 4096).total
    assert prefill_step(V3, hw.with_overrides(scale_out_gbps=100), inst, 2, 4096).total <= base
    assert prefill_step(V3, hw.with_overrides(scale_up_gbps=900), inst, 2, 4096).total <= base
    from dataclasses import replace
    assert prefill_step(V3, hw, replace(inst, imbalance=1.3), 2, 4096).total >= base


def test_hardware_file_normal_fields(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text("collectives:\n  deepep-ll-h800:\n    normal_rdma: {16: [20, 20]}\n")
    hw = HardwareDB(f).get("hgx-h800")
    assert hw.collective.normal_rdma == ((16, 20.0, 20.0),) and hw.collective.points  # the rest stays
    f.write_text("collectives:\n  deepep-ll-h800:\n    normal_rdma: {16: [0, 20]}\n")
    with pytest.raises(ValueError, match="normal_rdma"):
        HardwareDB(f).get("hgx-h800")
    f.write_text("collectives:\n  deepep-ll-h800:\n    normal_sm_share: 1.5\n")
    with pytest.raises(ValueError, match="normal_sm_share"):
        HardwareDB(f).get("hgx-h800")
    f.write_text("collectives:\n  deepep-ll-h800:\n    normal_rdma: {x: [1, 2]}\n")
    with pytest.raises(ValueError, match="normal_rdma must map"):
        HardwareDB(f).get("hgx-h800")
