"""Monotonicity properties of the cost model (hypothesis)."""
from hypothesis import given, settings, strategies as st

from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step

V3 = load_model("deepseek-v3")
HW = load_hardware("hgx-h800")
layouts = st.builds(Instance, cards=st.sampled_from([16, 32, 64]), tp=st.sampled_from([1, 2]),
                    moe_comm=st.sampled_from(["alltoall", "allgather"]),
                    micro_batch_overlap=st.booleans(), mtp_drafts=st.sampled_from([0, 1]),
                    overlap_shared=st.booleans(), weight_prefetch=st.booleans(),
                    flashcomm=st.sampled_from(["off", "on", "int8"]))
faster = st.floats(1.0, 4.0)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 16384), faster, faster, faster, faster, faster)
def test_more_bandwidth_or_flops_never_slower(inst, batch, ctx, f_flops, f_hbm, f_up, f_out, f_int8):
    better = HW.with_overrides(bf16_tflops=HW.bf16_tflops * f_flops, int8_tops=HW.int8_tops * f_int8,
                               fp8_tflops=HW.fp8_tflops * f_int8, hbm_tbps=HW.hbm_tbps * f_hbm,
                               scale_up_gbps=HW.scale_up_gbps * f_up, scale_out_gbps=HW.scale_out_gbps * f_out)
    assert decode_step(V3, better, inst, batch, ctx).total <= decode_step(V3, HW, inst, batch, ctx).total * (1 + 1e-9)
    assert prefill_step(V3, better, inst, 1, ctx).total <= prefill_step(V3, HW, inst, 1, ctx).total * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 63), st.integers(1, 64), st.integers(128, 8192))
def test_larger_batch_never_lowers_throughput_when_memory_bound(inst, b, extra, ctx):
    b2 = b + extra
    s1, s2 = decode_step(V3, HW, inst, b, ctx), decode_step(V3, HW, inst, b2, ctx)
    assert b2 / s2.total >= b / s1.total * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(1, 8192), st.integers(1, 8192))
def test_tpot_grows_with_context(inst, batch, ctx, extra):
    assert decode_step(V3, HW, inst, batch, ctx + extra).total >= decode_step(V3, HW, inst, batch, ctx).total


def test_small_batch_is_memory_bound():
    """The region the batch property speaks of: at batch 8 weight/KV streaming dominates compute."""
    st8 = decode_step(V3, HW, Instance(cards=32), 8, 2048)
    flops = sum(o.flops for o in st8.ops)
    assert st8.hbm_bytes / (HW.hbm_bw * HW.eff.memory) > flops / (HW.peak_flops("int8") * HW.eff.gemm)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 8192), st.floats(1.0, 3.0), st.floats(0.0, 1.0),
       st.sampled_from(["hgx-h800", "hgx-h20", "cloudmatrix-384-die", "atlas-800i-a2"]))
def test_more_imbalance_never_faster(inst, batch, ctx, imb, extra, hw_name):
    """Residual expert skew (issue 41), with and without two-batch overlap's family bound."""
    from dataclasses import replace
    hw = load_hardware(hw_name)
    lo, hi = replace(inst, imbalance=imb), replace(inst, imbalance=imb + extra)
    assert decode_step(V3, hw, hi, batch, ctx).total >= decode_step(V3, hw, lo, batch, ctx).total * (1 - 1e-9)
    assert prefill_step(V3, hw, hi, 2, ctx).total >= prefill_step(V3, hw, lo, 2, ctx).total * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 8192), faster, faster, st.floats(0.0, 1.0),
       st.sampled_from(["hgx-h100", "hgx-h20", "cloudmatrix-384-die", "gb200-nvl72"]))
def test_more_bandwidth_or_lower_latency_never_slower_on_each_family(inst, batch, ctx, f_up, f_out, f_lat, hw_name):
    hw = load_hardware(hw_name)
    better = hw.with_overrides(scale_up_gbps=hw.scale_up_gbps * f_up, scale_out_gbps=hw.scale_out_gbps * f_out,
                               link_latency_us=hw.eff.link_latency_us * f_lat,
                               out_latency_us=hw.eff.latency_out_us * f_lat)
    assert decode_step(V3, better, inst, batch, ctx).total <= decode_step(V3, hw, inst, batch, ctx).total * (1 + 1e-9)
    assert prefill_step(V3, better, inst, 2, ctx).total <= prefill_step(V3, hw, inst, 2, ctx).total * (1 + 1e-9)
