"""The calibration table: structure, units, and that it is computed from the shared data."""
import json

import pytest

from moeserve.planner.calibrate import load_cases, validate
from moeserve.planner.cli import main

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
    assert set(obj) >= {"rows", "all_within", "tolerance_pct"}


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


@pytest.mark.xfail(strict=True, reason="known miss, docs/planner.md 'Calibration': the kernel-level "
                   "model is 1.5-2x more optimistic than the published systems")
def test_all_published_results_within_15_percent():
    assert validate()["all_within"]
