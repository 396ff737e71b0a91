"""Overlaps and traffic the published design and moeserve's engine have: shared experts during the
first MoE collective, attention-weight prefetch, FlashComm, MoE permute traffic, MTP in prefill."""
import pytest

from moeserve.perf import cost, moe
from moeserve.perf.deploy import Instance, PlanError
from moeserve.perf.step import decode_step, prefill_step
from tests.planner.helpers import TOY_HW as HW, TOY_MODEL as M

H = M.hidden_size


def test_moe_permute_hand_cases():
    a2a = moe.moe_permute(M, HW, Instance(cards=4), q=100, n_tokens=400)
    assert a2a.nbytes == 100 * (2 + 1) * H * 2          # k=2 copies summed back + the token's row written
    inst = Instance(cards=4, moe_comm="allgather")
    copies, _ = moe.routed_load(M, inst, 400)
    ag = moe.moe_permute(M, HW, inst, q=100, n_tokens=400)
    assert ag.nbytes == pytest.approx((copies + 400) * H * 2)  # copies read + the full [N, H] BF16 buffer
    assert ag.seconds == pytest.approx(ag.nbytes / (HW.hbm_bw * HW.eff.memory))


@pytest.mark.parametrize("comm", ["alltoall", "allgather"])
def test_shared_experts_hide_behind_the_first_collective(comm):
    on = decode_step(M, HW, Instance(cards=4, moe_comm=comm), 32, 100)
    off = decode_step(M, HW, Instance(cards=4, moe_comm=comm, overlap_shared=False), 32, 100)
    b_on, b_off = on.by_name(), off.by_name()
    first = b_off["dispatch" if comm == "alltoall" else "allgather"]
    independent = b_off["shared_experts"] + (b_off["router"] if comm == "allgather" else 0.0)
    assert b_on["comm_overlap"] == pytest.approx(-min(first, independent))
    assert off.total - on.total == pytest.approx(min(first, independent))
    assert "comm_overlap" not in b_off


def test_dedicated_shared_ranks_get_no_overlap_credit():
    st = decode_step(M, HW, Instance(cards=5, shared_expert_ranks=1), 32, 100)
    assert st.by_name().get("comm_overlap", 0.0) == 0.0


def test_two_batch_overlap_does_not_also_take_the_shared_credit():
    st = decode_step(M, HW, Instance(cards=4, micro_batch_overlap=True, weight_prefetch=True), 32, 100)
    names = st.by_name()
    assert "comm_overlap" not in names and "weight_prefetch" not in names


def test_flashcomm_int8_moves_a_quarter_fewer_bytes_and_shards_elementwise():
    rows = 100 * H
    off = cost.tp_allreduce(M, HW, Instance(cards=4, tp=2), 100)
    on = cost.tp_allreduce(M, HW, Instance(cards=4, tp=2, flashcomm="on"), 100)
    i8 = cost.tp_allreduce(M, HW, Instance(cards=4, tp=2, flashcomm="int8"), 100)
    assert [o.name for o in off] == ["tp_allreduce"]
    assert [o.name for o in i8] == ["tp_reduce_scatter", "tp_allgather"]
    assert sum(o.seconds for o in on) == pytest.approx(off[0].seconds)  # RS + BF16 AG = AllReduce
    lat = HW.eff.link_latency_us * 1e-6
    bw_time = lambda ops: sum(o.seconds for o in ops) - lat * len(ops)
    # RS 2 B + AG (1 B + 4 B scale per row) vs 2 x 2 B: -25% of the bytes (system-brief item 7)
    assert bw_time(i8) / bw_time(on) == pytest.approx((2 * rows + rows + 4 * 100) / (4 * rows))
    e_off = cost.elementwise(M, HW, Instance(cards=4, tp=2), 100)
    e_fc = cost.elementwise(M, HW, Instance(cards=4, tp=2, flashcomm="int8"), 100)
    assert e_fc.nbytes == e_off.nbytes / 2
    with pytest.raises(PlanError, match="flashcomm"):
        Instance(cards=4, flashcomm="fp4")


def test_weight_prefetch_is_capped_by_the_published_gain_and_the_window():
    inst = Instance(cards=4, weight_prefetch=True)
    st = decode_step(M, HW, inst, 8, 100)
    base = decode_step(M, HW, Instance(cards=4), 8, 100)
    b, b0 = st.by_name(), base.by_name()
    hidden = -b["weight_prefetch"]
    attention = b0["attn_proj"] + b0["mla_decode"]
    assert 0 < hidden <= attention * (1 - 1 / 1.1) + 1e-12
    window = sum(b0[k] for k in ("dispatch", "combine")) + b0.get("comm_overlap", 0.0)
    assert hidden <= window + 1e-12
    assert base.total - st.total == pytest.approx(hidden)


def test_weight_prefetch_does_nothing_when_projections_are_compute_bound():
    from moeserve.perf.hardware import load_hardware
    from moeserve.perf.models import load_model
    v3, a2 = load_model("deepseek-v3"), load_hardware("atlas-800i-a2")
    inst = Instance(cards=16, tp=2, moe_comm="allgather")
    # a 2K-token prefill: the projections' FLOPs outlast their weight reads
    on = prefill_step(v3, a2, Instance(cards=16, tp=2, moe_comm="allgather", weight_prefetch=True), 1, 2048)
    off = prefill_step(v3, a2, inst, 1, 2048)
    proj = next(o for o in off.ops if o.name == "attn_proj")
    assert proj.prefetchable == 0.0 and on.total == pytest.approx(off.total)
    # decode: the weight reads are what the projections wait on
    dec = next(o for o in decode_step(v3, a2, inst, 8, 2048).ops if o.name == "attn_proj")
    assert dec.prefetchable == pytest.approx(dec.seconds, rel=0.05)


def test_prefill_with_mtp_runs_the_mtp_layer_over_the_prompt():
    base = prefill_step(M, HW, Instance(cards=4), 2, 512)
    mtp = prefill_step(M, HW, Instance(cards=4, mtp_drafts=1), 2, 512)
    b = mtp.by_name()
    assert b["mtp_attn_prefill"] == pytest.approx(base.by_name()["attn_prefill"] / M.num_hidden_layers)
    assert b["mtp_lm_head"] == pytest.approx(cost.lm_head(M, HW, Instance(cards=4), 2).seconds)
    assert mtp.total > base.total
