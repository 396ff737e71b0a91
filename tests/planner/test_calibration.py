"""The calibration table: structure, units, and that it is computed from the shared data."""
import json

import pytest

from moeserve.planner.calibrate import load_cases, validate
from moeserve.planner.cli import main
from moeserve.planner.hardware import HardwareDB

PUBLISHED = {"cloudmatrix384-decode": 1920, "a2-decode-2k2k": 808, "a2-decode-1k2k": 808,
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


def test_serving_factor_is_one_documented_number_for_every_device():
    """end_to_end = hardware.md's end-to-end HBM midpoint (30-50% -> 0.40) over the kernel midpoint
    (70-85% -> 0.775); the same for NVIDIA and Ascend, and no device carries its own."""
    raw = HardwareDB().raw["efficiency"]
    assert raw["default_profile"] == "end_to_end"
    assert raw["profiles"]["end_to_end"]["serving"] == pytest.approx(0.40 / 0.775, abs=1e-3)
    assert raw["profiles"]["end_to_end"]["serving"] == pytest.approx(0.40 / raw["default"]["memory"], abs=1e-3)
    assert raw["profiles"]["kernel"]["serving"] == 1.0
    assert not any("serving" in (v or {}) for v in (raw.get("devices") or {}).values())
    e2e, kern = HardwareDB(), HardwareDB(profile="kernel")
    for name in e2e.names():
        assert e2e.get(name).eff.serving == raw["profiles"]["end_to_end"]["serving"]
        assert kern.get(name).eff.serving == 1.0
        assert e2e.get(name).eff.gemm == kern.get(name).eff.gemm  # kernel factors are shared


def test_rows_carry_the_kernel_only_prediction():
    res, kern = validate(), validate(profile="kernel")
    assert res["efficiency_profile"] == "end_to_end" and kern["efficiency_profile"] == "kernel"
    for r, k in zip(res["rows"] + res["unlisted"], kern["rows"] + kern["unlisted"]):
        assert r["predicted_kernel"] == k["predicted"]


def test_end_to_end_profile_moves_every_case_toward_the_published_figure():
    """Including the unlisted H800 checks (DeepSeek's own figures), which nothing was chosen from."""
    res = validate()
    assert {r["id"] for r in res["unlisted"]} == {"h800-decode", "h800-prefill"}
    for r in res["rows"] + res["unlisted"]:
        assert abs(r["error_pct"]) <= abs(r["error_kernel_pct"]) + 0.05, r["id"]


def test_rows_the_documented_factors_reproduce():
    """Regression guard for the rows that land within +-15% (docs/planner.md 'Calibration')."""
    ok = {r["id"]: r["within_tolerance"] for r in validate()["rows"]}
    assert ok["cloudmatrix384-decode"] and ok["a2-decode-1k2k"]


def test_decode_rows_land_on_the_published_operating_point():
    """808 tok/s/card at TPOT 100 ms with 1.7 tokens per step means ~81 sequences per card; CloudMatrix's
    1920 at 50 ms means ~96. The model's SLO batches are those, not only the throughputs."""
    rows = {r["id"]: r for r in validate()["rows"]}
    for rid, tpot in (("cloudmatrix384-decode", 50), ("a2-decode-1k2k", 100)):
        implied = rows[rid]["published"] * tpot * 1e-3
        assert rows[rid]["detail"]["batch_per_dp"] == pytest.approx(implied, rel=0.05), rid


@pytest.mark.xfail(strict=True, reason="known miss, docs/planner.md 'Calibration': A2 decode 2K+2K is "
                   "-18% and A2 prefill TTFT -23%; no single set of efficiency factors inside their documented "
                   "ranges reaches +-15% on every row (plan validate --feasibility: 21.0% at best), and the "
                   "published prefill is slower than the slow end of its band")
def test_all_published_results_within_15_percent():
    assert validate()["all_within"]
