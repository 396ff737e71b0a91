"""The calibration table: structure, units, and that it is computed from the shared data."""
import json

import pytest

from moeserve.planner.calibrate import load_cases, validate
from moeserve.planner.cli import main
from moeserve.perf.hardware import HardwareDB

PUBLISHED = {"cloudmatrix384-decode": 960,  # 1920 per 910C card (chip) = 960 per die, the rank
             "a2-decode-2k2k": 808, "a2-decode-1k2k": 808,
             "a2-prefill-ttft": 631, "a2-prefill-throughput": 1622}


def test_rows_carry_published_and_predicted_in_one_unit():
    res = validate()
    assert {r["id"]: r["published"] for r in res["rows"]} == PUBLISHED
    for r in res["rows"]:
        assert r["unit"] in ("tok_s_card", "ttft_ms") and r["predicted"] > 0
        assert r["error_pct"] == pytest.approx(100 * (r["predicted"] - r["published"]) / r["published"], abs=0.1)
        assert r["within_tolerance"] == (abs(r["error_pct"]) <= 15.0 + 0.05)
    ttft, tput = (next(r for r in res["rows"] if r["id"] == k) for k in ("a2-prefill-ttft", "a2-prefill-throughput"))
    assert tput["predicted"] == pytest.approx(16384 / (ttft["predicted"] / 1e3) / 16, rel=1e-3)


def test_cli_json_is_one_object(capsys):
    assert main(["plan", "validate", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) >= {"rows", "all_within", "tolerance_pct", "efficiency_profile", "unlisted"}
    for r in obj["rows"] + obj["unlisted"]:
        assert {"published", "predicted", "predicted_kernel"} <= set(r)


def test_predictions_come_from_the_shared_efficiency_data(tmp_path):
    base = {r["id"]: r["predicted"] for r in validate()["rows"]}
    f = tmp_path / "eff.yaml"
    f.write_text("efficiency:\n  default:\n    gemm: 0.4\n    attention: 0.3\n")
    slower = {r["id"]: r["predicted"] for r in validate(str(f))["rows"]}
    assert slower["a2-prefill-ttft"] > base["a2-prefill-ttft"]
    assert slower["cloudmatrix384-decode"] < base["cloudmatrix384-decode"]


def test_cases_use_only_layout_fields():
    """Cases choose layouts; no case may carry its own efficiency factor (no per-case fitting)."""
    for case in load_cases()["cases"]:
        assert not {"efficiency", "gemm", "memory", "attention", "link"} & set(case["instance"])


def test_no_end_to_end_factor_only_terms():
    """No profile stretches the operators: end_to_end pays every documented term, kernel none."""
    from moeserve.perf.hardware import TERMS
    raw = HardwareDB().raw["efficiency"]
    assert raw["default_profile"] == "end_to_end"
    assert all(p["serving"] == 1.0 for p in raw["profiles"].values())
    assert not any("serving" in (v or {}) for v in (raw.get("devices") or {}).values())
    e2e, kern = HardwareDB(), HardwareDB(profile="kernel")
    for name in e2e.names():
        assert e2e.get(name).eff.terms == TERMS and kern.get(name).eff.terms == ()
        assert e2e.get(name).eff.serving == 1.0
        assert e2e.get(name).eff.gemm == kern.get(name).eff.gemm  # kernel factors are shared


def test_rows_carry_the_kernel_only_prediction():
    res, kern = validate(), validate(profile="kernel")
    assert res["efficiency_profile"] == "end_to_end" and kern["efficiency_profile"] == "kernel"
    for r, k in zip(res["rows"] + res["unlisted"], kern["rows"] + kern["unlisted"]):
        assert r["predicted_kernel"] == k["predicted"]


def test_every_term_costs_time():
    """The terms only add what a serving step pays beyond its kernels: end_to_end is never faster."""
    res = validate()
    assert {r["id"] for r in res["unlisted"]} == {"h800-decode", "h800-prefill"}
    for r in res["rows"] + res["unlisted"]:
        if r["unit"] == "ttft_ms":
            assert r["predicted"] >= r["predicted_kernel"] - 0.05, r["id"]
        else:
            assert r["predicted"] <= r["predicted_kernel"] + 0.05, r["id"]


def test_a2_decode_rows_run_the_published_batch():
    """Omni-Infer's template caps a decode rank at 60 sequences; both A2 decode rows meet TPOT 100 ms there,
    so the published layout, not the SLO, sets their batch."""
    rows = {r["id"]: r for r in validate()["rows"]}
    for rid in ("a2-decode-2k2k", "a2-decode-1k2k"):
        assert rows[rid]["detail"]["batch_per_dp"] == 60 and rows[rid]["detail"]["tpot_ms"] < 100


@pytest.mark.xfail(strict=True, reason="known miss, docs/planner.md 'Calibration': from operator-level facts "
                   "alone every Ascend row is too fast: A2 decode +20/+31%, A2 prefill TTFT -33%, CloudMatrix "
                   "decode +57% (1920 per 910C card = 960 per die, 'The CloudMatrix unit'); nothing is fitted to "
                   "close the gaps")
def test_all_published_results_within_15_percent():
    assert validate()["all_within"]


def test_validate_prints_each_rows_step_by_term(capsys):
    """Every row's step split into its terms: shares sum to 100, each is its operators' milliseconds over the
    step (here dispatch + combine), and the text prints one line per row (issue 41)."""
    assert main(["plan", "validate", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    for r in obj["rows"] + obj["unlisted"]:
        shares = r["step_shares_pct"]
        assert sum(shares.values()) == pytest.approx(100, abs=0.6), r["id"]
        assert {"attention", "moe_gemm", "dispatch_combine", "framework"} <= set(shares), r["id"]
    cm = next(r for r in obj["rows"] if r["id"] == "cloudmatrix384-decode")
    br = cm["detail"]["breakdown_ms"]
    moe_comm = sum(v for k, v in br.items() if k.removeprefix("mtp_") in ("dispatch", "combine"))
    assert cm["step_shares_pct"]["dispatch_combine"] == pytest.approx(100 * moe_comm / cm["detail"]["step_ms"],
                                                                      abs=0.05)
    assert main(["plan", "validate"]) == 0
    text = capsys.readouterr().out
    assert "share of the step by term" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("a2-prefill-ttft ") and "tp_" in ln)
    a2 = next(r for r in obj["rows"] if r["id"] == "a2-prefill-ttft")["step_shares_pct"]
    assert f"dispatch_combine {a2['dispatch_combine']:.1f}" in line
    assert f"tp_collectives {a2['tp_collectives']:.1f}" in line
