"""Documented efficiency ranges: the band every prediction carries, the file rules that pin a factor, and
`validate --feasibility` (docs/planner.md "Uncertainty band")."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from moeserve.planner.analysis import band, best_under_slo
from moeserve.planner.calibrate import feasibility, format_feasibility, validate
from moeserve.planner.cli import main
from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.hardware import HardwareDB, load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step

V3 = load_model("deepseek-v3")
# The default (Ascend, CANN) factors' documented ranges; NVIDIA devices set their own measured factors,
# which are pinned (no band).
E2E = {"gemm": (0.774, 0.827), "attention": (0.55, 0.66), "attention_memory": (0.70, 0.85),
       "memory": (0.70, 0.85), "gemm_memory": (0.70, 0.85)}
NVIDIA = ("h100", "h800", "h200", "h20", "b200", "gb200", "gb300")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    return str(path)


def test_builtin_ranges_hold_the_point_values():
    db = HardwareDB()
    for name in db.names():
        eff = db.get(name).eff
        nvidia = name.removeprefix("hgx-").removesuffix("-nvl72") in NVIDIA
        assert {k: (lo, hi) for k, lo, hi in eff.ranges} == ({} if nvidia else E2E), name
        for k, lo, hi in eff.ranges:
            assert lo <= getattr(eff, k) <= hi
    kernel = HardwareDB(profile="kernel").get("910b").eff
    assert kernel.serving == 1.0 and "serving" not in {r[0] for r in kernel.ranges}


def test_ends_move_every_ranged_factor():
    eff = load_hardware("910b").eff
    low, high = eff.at("low"), eff.at("high")
    assert (low.gemm, low.attention, low.memory, low.gemm_memory) == (0.774, 0.55, 0.70, 0.70)
    assert (high.gemm, high.attention, high.memory, high.attention_memory) == (0.827, 0.66, 0.85, 0.85)
    assert low.ranges == () and low.link == eff.link and low.serving == 1.0  # unranged factors stay
    with pytest.raises(ValueError, match="'low' or 'high'"):
        eff.at("middle")


layouts = st.builds(Instance, cards=st.sampled_from([16, 32, 64]), tp=st.sampled_from([1, 2]),
                    moe_comm=st.sampled_from(["alltoall", "allgather"]), micro_batch_overlap=st.booleans(),
                    mtp_drafts=st.sampled_from([0, 1]), overlap_shared=st.booleans(),
                    weight_prefetch=st.booleans(), flashcomm=st.sampled_from(["off", "on", "int8"]),
                    quantization=st.sampled_from(["a8w8", "fp8", "bf16"]))


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 16384),
       st.sampled_from(["hgx-h800", "atlas-800i-a2", "cloudmatrix-384"]))
def test_band_brackets_the_point(inst, batch, ctx, name):
    """What makes two runs a band: every step time is monotone in every ranged factor."""
    hw = load_hardware(name)
    if inst.quantization == "fp8" and not hw.fp8_tflops:
        return
    for step in (lambda h: decode_step(V3, h, inst, batch, ctx).total,
                 lambda h: prefill_step(V3, h, inst, 1, ctx).total):
        lo, mid, hi = step(hw.at("high")), step(hw), step(hw.at("low"))
        assert lo <= mid * (1 + 1e-9) and mid <= hi * (1 + 1e-9)
        # One factor at a time too: no factor may speed the step up by going down.
        for k, low, high in hw.eff.ranges:
            assert step(hw.with_overrides(**{k: high})) <= step(hw.with_overrides(**{k: low})) * (1 + 1e-9), k


def test_band_of_a_decode_slo_point():
    hw, inst = load_hardware("atlas-800i-a2"), Instance(cards=32, moe_comm="allgather", mtp_drafts=1)
    wl = Workload(2048, 2048)
    point = best_under_slo(V3, hw, inst, wl, 100).tok_s_card
    lo, hi = band(lambda h: best_under_slo(V3, h, inst, wl, 100).tok_s_card, hw)
    assert lo < point < hi
    assert band(lambda h: 1.0, load_hardware("h800", profile="kernel").with_overrides(
        gemm=0.8, attention=0.6, memory=0.775)) is None  # every factor pinned: no band


def test_a_file_factor_without_its_range_is_pinned(tmp_path):
    path = _write(tmp_path, "efficiency:\n  default: {gemm: 0.5}\n  profiles:\n    end_to_end: {serving: 0.43}\n")
    eff = HardwareDB(path).get("910b").eff
    assert eff.gemm == 0.5 and eff.serving == 0.43
    assert {r[0] for r in eff.ranges} == set(E2E) - {"gemm"}


def test_a_profile_factor_is_described_by_the_profiles_range(tmp_path):
    path = _write(tmp_path, "efficiency:\n  profiles:\n    end_to_end: {gemm: 0.7}\n")
    eff = HardwareDB(path).get("910b").eff  # the shared [0.774, 0.827] does not describe the profile's 0.7
    assert eff.gemm == 0.7 and "gemm" not in {r[0] for r in eff.ranges}
    path = _write(tmp_path, "efficiency:\n  profiles:\n    end_to_end: {gemm: 0.7, ranges: {gemm: [0.6, 0.75]}}\n")
    eff = HardwareDB(path).get("910b").eff
    assert ("gemm", 0.6, 0.75) in eff.ranges and ("memory", 0.70, 0.85) in eff.ranges
    assert ("gemm", 0.774, 0.827) in HardwareDB(path, "kernel").get("910b").eff.ranges


def test_a_file_may_give_ranges_and_device_factors_pin(tmp_path):
    path = _write(tmp_path, "efficiency:\n  default: {gemm: 0.5}\n  ranges: {gemm: [0.4, 0.6], link: [0.7, 0.9]}\n"
                            "  devices:\n    910b3: {memory: 0.6}\n")
    db = HardwareDB(path)
    assert ("gemm", 0.4, 0.6) in db.get("910b").eff.ranges and ("link", 0.7, 0.9) in db.get("910b").eff.ranges
    assert "memory" not in {r[0] for r in db.get("910b3").eff.ranges}
    assert "memory" in {r[0] for r in db.get("910b").eff.ranges}
    # A factor overridden in code (cpucheck, tests) is pinned too.
    assert "gemm" not in {r[0] for r in db.get("910b").with_overrides(gemm=0.9).eff.ranges}


@pytest.mark.parametrize("text, needles", [
    ("efficiency:\n  ranges: {gemm: [0.9, 0.95]}\n", ["gemm 0.8", "outside its range", "[0.9, 0.95]",
                                                      "(efficiency.default.gemm)", "(efficiency.ranges.gemm)"]),
    ("efficiency:\n  ranges: {gemm: [0.9, 0.1]}\n", ["efficiency.ranges.gemm", "low <= high"]),
    ("efficiency:\n  ranges: {gemm: 0.8}\n", ["efficiency.ranges.gemm", "[low, high]"]),
    ("efficiency:\n  ranges: {gemm: [0.5, 1.5]}\n", ["efficiency.ranges.gemm", "<= 1"]),
    ("efficiency:\n  ranges: {step_overhead_ms: [0.5, 1.5]}\n", ["efficiency.ranges", "'step_overhead_ms'"]),
    ("efficiency:\n  ranges: [0.5, 1.5]\n", ["efficiency.ranges must be a mapping"]),
    ("efficiency:\n  default: {ranges: {gemm: [0.7, 0.9]}}\n",  # where they go, not the list of factors
     ["efficiency.default cannot hold ranges", "efficiency.ranges or efficiency.profiles.<profile>.ranges"]),
    ("efficiency:\n  devices:\n    h20: {ranges: {gemm: [0.7, 0.9]}}\n", ["efficiency.devices.h20 cannot hold ranges"]),
    ("efficiency:\n  profiles:\n    end_to_end: {ranges: {serving: [0.2, 0.3]}}\n",
     ["serving 1 (efficiency.profiles.end_to_end.serving)", "outside its range",
      "(efficiency.profiles.end_to_end.ranges.serving)"]),
])
def test_bad_ranges_are_refused_naming_the_field(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        HardwareDB(path)
    for n in needles:
        assert n in str(err.value), (n, str(err.value))
    assert main(["plan", "hardware", "--hardware-file", path]) == 2


def test_validate_rows_carry_the_band():
    res = validate()
    for row in res["rows"] + res["unlisted"]:
        if row["id"].startswith("h800"):  # NVIDIA factors are pinned device measurements: no band
            assert row["band"] is None and not row["published_in_band"]
            continue
        lo, hi = row["band"]
        assert lo <= row["predicted"] <= hi, row["id"]
        assert row["published_in_band"] == (lo <= row["published"] <= hi)
        assert row["band_error_pct"][0] <= row["error_pct"] <= row["band_error_pct"][1]


def test_feasibility_is_never_worse_than_the_point_values():
    """The grid holds the values in use, so its best worst-case error is at most the planner's own."""
    res = feasibility(points=2)
    point = max(abs(r["error_pct"]) for r in validate()["rows"])
    assert res["best_max_abs_error_pct"] <= point + 0.05
    assert res["reachable"] == (res["best_max_abs_error_pct"] <= res["tolerance_pct"])
    assert set(res["grid"]) == set(E2E) and res["combinations"] == 3 ** 5  # 2 ends + the value in use
    for k, v in res["best_factors"].items():
        assert E2E[k][0] <= v <= E2E[k][1]


def test_feasibility_with_every_factor_pinned_is_the_point(tmp_path):
    path = _write(tmp_path, "efficiency:\n  default: {gemm: 0.79, attention: 0.6, memory: 0.775, gemm_memory: 0.7, "
                            "attention_memory: 0.8}\n")
    res = feasibility(path)
    assert res["combinations"] == 1 and res["grid"] == {}
    errs = {r["id"]: r["error_pct"] for r in validate(path)["rows"]}
    assert res["best_errors_pct"] == pytest.approx(errs, abs=0.06)
    assert "% at the values in use (no factor has a range)\n" in format_feasibility(res)  # was "at " and nothing


def test_cli_reports_bands(capsys):
    a2 = ["--hardware", "atlas-800i-a2", "--cards", "32", "--moe-comm", "allgather", "--mtp-drafts", "1"]
    assert main(["plan", "decode", "--json", "--tpot-ms", "100", *a2]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["best_band_tok_s_card"][0] < obj["best_under_slo"]["tok_s_card"] < obj["best_band_tok_s_card"][1]
    assert main(["plan", "prefill", "--json", "--hardware", "atlas-800i-a2", "--cards", "16", "--tp", "2"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["band_ttft_ms"][0] < obj["ttft_ms"] < obj["band_ttft_ms"][1]
    assert main(["plan", "estimate", "--json", "--batch", "16", *a2]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["decode"]["band_tok_s_card"][0] < obj["decode"]["tok_s_card"] < obj["decode"]["band_tok_s_card"][1]
    assert obj["prefill"]["band_ttft_ms"][0] < obj["prefill"]["ttft_ms"] < obj["prefill"]["band_ttft_ms"][1]
    assert main(["plan", "decode", "--tpot-ms", "100", *a2]) == 0
    assert "efficiency ranges:" in capsys.readouterr().out.splitlines()[-1]
    assert main(["plan", "decode", "--json", "--tpot-ms", "100", "--efficiency-profile", "kernel", *a2]) == 0
    obj = json.loads(capsys.readouterr().out)  # the kernel profile has no serving range, still a band
    assert obj["best_band_tok_s_card"] is not None


def test_cli_validate_feasibility(capsys):
    assert main(["plan", "validate", "--feasibility", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["feasibility"]["combinations"] > 1 and "best_factors" in obj["feasibility"]
    assert main(["plan", "validate", "--feasibility"]) == 0
    out = capsys.readouterr().out
    assert "feasibility (end_to_end" in out and "band (documented ranges)" in out


def test_search_plans_carry_a_goodput_band(capsys):
    assert main(["plan", "search", "--json", "--hardware", "atlas-800i-a2", "--cards", "48", "--tpot-ms", "100",
                 "--mtp-drafts", "1", "--top", "3"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans
    for pl in plans:
        lo, hi = pl["band_goodput_tok_s_card"]
        # The plan's own goodput, recomputed at the point values, lies inside (same counts, same batch).
        assert lo < pl["goodput_tok_s_card"] < hi


def test_plan_goodput_at_the_point_values_is_the_plans_own():
    from moeserve.planner import search as srch
    hw, wl = load_hardware("atlas-800i-a2"), Workload(2048, 2048)
    base = Instance(cards=32, mtp_drafts=1)
    decs = srch.best_decode(V3, hw, 48, base, wl, 100, top=None)
    pres = srch.best_prefill(V3, hw, 48, base, wl, top=None)
    pairs = [(d, p, srch.split(48, d, p, wl)) for d in decs for p in pres[:6]]
    pairs = [x for x in pairs if x[2]][:12]  # the fastest decode layouts take all 48 cards: no split
    assert len(pairs) >= 3
    for d, p, plan in pairs:
        got = srch.plan_goodput(V3, hw, plan, d, p, wl, 100)
        assert got == pytest.approx(plan["goodput_tok_s_card"], abs=0.06)


def test_feasibility_grid_stays_inside_the_ranges(tmp_path):
    """Grid values are rounded for display; a rounded low end of 1e-6 was 0 and refused as a factor."""
    path = _write(tmp_path, "efficiency:\n  default: {attention: 0.6, memory: 0.775, gemm_memory: 0.7, "
                            "attention_memory: 0.8}\n  ranges: {gemm: [0.000001, 0.83333]}\n")
    res = feasibility(path, points=2)
    assert res["grid"] == {"gemm": [0.000001, 0.8, 0.8333]}
    assert 0.000001 <= res["best_factors"]["gemm"] <= 0.83333



def test_search_goodput_band_keeps_the_ttft_slo():
    """At the slow end no prefill batch meets the TTFT SLO: no request is served within it, goodput 0 (the
    band's low end was the goodput of prompts served too late)."""
    from moeserve.planner import search as srch
    from moeserve.planner.analysis import prefill_point
    hw, wl = load_hardware("atlas-800i-a2"), Workload(4096, 512)
    free = srch.search(V3, hw, 48, wl, 100, Instance(cards=32, mtp_drafts=1), top=1)["plans"][0]
    pre = Instance(**free["prefill"]["layout"])
    fast, slow = (prefill_point(V3, h, pre, pre.dp, wl.input_len).ttft_ms for h in (hw, hw.at("low")))
    slo = (fast + slow) / 2 + 5  # the point meets it (with the KV pull), the slow end does not
    res = srch.search(V3, hw, 48, wl, 100, Instance(cards=32, mtp_drafts=1), ttft_ms=slo, top=1)
    pl = res["plans"][0]
    dec, pre = (srch.Candidate(r, Instance(**pl[r]["layout"]), 0.0, 0.0, pl[r]["batch_per_dp"])
                for r in ("decode", "prefill"))
    slow = prefill_point(V3, hw.at("low"), pre.inst, pre.inst.dp, wl.input_len)  # one prompt per DP group
    assert slow.ttft_ms + res["kv_pull_ms"] > slo
    lo, hi = pl["band_goodput_tok_s_card"]
    assert lo == 0.0 < pl["goodput_tok_s_card"] < hi
    assert srch.plan_goodput(V3, hw.at("low"), pl, dec, pre, wl, 100) > 50  # SLO-blind
    # At the point values: the plan's own goodput, as without the SLO.
    assert srch.plan_goodput(V3, hw, pl, dec, pre, wl, 100, slo, 48) == pytest.approx(pl["goodput_tok_s_card"],
                                                                                     abs=0.06)


@pytest.mark.parametrize("text, profile", [
    ("efficiency:\n  ranges: {serving: [0.3, 0.6]}\n", "end_to_end"),  # every built-in profile sets serving
    ("efficiency:\n  ranges: {serving: [0.3, 1.0]}\n", "kernel"),
    ("efficiency:\n  ranges: {gemm: [0.6, 0.9]}\n  profiles:\n    end_to_end: {gemm: 0.7}\n", "end_to_end"),
])
def test_a_shared_range_the_profile_overrides_is_refused(tmp_path, text, profile):
    """It would be silently ignored: the profile's own value is described by the profile's range."""
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=rf"efficiency.ranges.\w+ does not apply to profile {profile}.*"
                                         rf"efficiency.profiles.{profile}.ranges"):
        HardwareDB(path, profile)
    path = _write(tmp_path, "efficiency:\n  ranges: {gemm: [0.6, 0.9]}\n  profiles:\n    end_to_end: {gemm: 0.7}\n")
    assert ("gemm", 0.6, 0.9) in HardwareDB(path, "kernel").get("910b").eff.ranges  # kernel keeps gemm 0.8


def test_a_profile_nothing_selects_is_refused(tmp_path):
    """A misspelt profile name was a new, unused profile: its factors silently ignored."""
    path = _write(tmp_path, "efficiency:\n  profiles:\n    end-to-end: {serving: 0.4}\n")
    with pytest.raises(ValueError, match="efficiency.profiles.end-to-end is never used"):
        HardwareDB(path)
    path = _write(tmp_path, "efficiency:\n  default_profile: mine\n  profiles:\n    mine: {serving: 0.4}\n")
    assert HardwareDB(path).get("910b").eff.serving == 0.4
