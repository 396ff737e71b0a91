"""`plan validate`'s per-term shares of the step (issue 41): every operator the cost model emits belongs to a
named term, on every layout, so a miss always points at a term (never at "other")."""
import itertools

import pytest

from moeserve.perf.deploy import Instance, fewest_redundant_slots
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step
from moeserve.planner.explain import SHARE_TERMS, TERM_OF, step_shares

V3 = load_model("deepseek-v3")
LAYOUTS = [dict(cards=c, tp=tp, moe_comm=comm, mtp_drafts=d, micro_batch_overlap=tbo, weight_prefetch=wp,
                flashcomm=fc, shared_expert_ranks=s)
           for c, tp, comm, d, tbo, wp, fc, s in itertools.product(
               [8, 32], [1, 4], ["alltoall", "allgather"], [0, 1], [False, True], [False, True],
               ["off", "int8"], [0, 1])
           if not (fc != "off" and tp == 1)]


@pytest.mark.parametrize("hw_name,quant", [("atlas-800i-a2", "a8w8"), ("hgx-h800", "fp8"),
                                           ("gb200-nvl72", "nvfp4"), ("mi355x-8", "mxfp4")])
def test_every_operator_has_a_term(hw_name, quant):
    hw = load_hardware(hw_name)
    for kw in LAYOUTS:
        inst = Instance(**kw, quantization=quant, redundant_experts=fewest_redundant_slots(
            V3.n_routed_experts, kw["cards"] - kw["shared_expert_ranks"]))
        for step in (decode_step(V3, hw, inst, 16, 2048), prefill_step(V3, hw, inst, 2, 2048)):
            names = {o.name.removeprefix("mtp_") for o in step.ops}
            assert names <= set(TERM_OF), (hw_name, kw, names - set(TERM_OF))
            ms = {k: 1e3 * v for k, v in step.by_name().items()}  # as analysis.py's breakdown_ms
            shares = step_shares({**ms, "framework_overhead": 1e3 * step.overhead}, 1e3 * step.total)
            assert set(shares) <= set(SHARE_TERMS) and sum(shares.values()) == pytest.approx(100, abs=0.6)


def test_shares_by_hand():
    """2 ms attention, 1 + 1 ms dispatch/combine, 1 ms routed experts, -1 ms overlap, 1 ms framework:
    a 5 ms step."""
    shares = step_shares({"mla_decode": 2, "dispatch": 1, "combine": 1, "routed_experts": 1,
                          "comm_overlap": -1, "framework_overhead": 1}, 5)
    assert shares == {"attention": 40.0, "moe_gemm": 20.0, "dispatch_combine": 40.0, "overlap": -20.0,
                      "framework": 20.0}
    # what the breakdown leaves out of the total (prefill two-batch overlap's saving) is overlap
    assert step_shares({"mla_decode": 2, "dispatch": 3}, 4)["overlap"] == -25.0
