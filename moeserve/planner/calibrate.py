"""`moeserve plan validate`: predicted vs published for the cases in data/published.yaml.

The cases only choose layouts; every efficiency factor is the shared one from hardware.yaml.
"""
from __future__ import annotations

from importlib import resources

import yaml

from moeserve.planner.analysis import best_under_slo, prefill_point
from moeserve.planner.deploy import Instance, Workload
from moeserve.planner.hardware import HardwareDB
from moeserve.planner.models import load_model


def load_cases() -> dict:
    text = resources.files("moeserve.planner").joinpath("data/published.yaml").read_text()
    return yaml.safe_load(text)


def predict(case: dict, db: HardwareDB, model: str = "deepseek-v3") -> dict:
    m, hw = load_model(model), db.get(case["hardware"])
    inst = Instance(**case["instance"])
    metric = case["published"]["metric"]
    if case["kind"] == "decode":
        pt = best_under_slo(m, hw, inst, Workload(**case["workload"]), case["tpot_ms"])
        detail = pt.to_dict() if pt else {}
        value = pt.tok_s_card if pt else 0.0
    else:
        pt = prefill_point(m, hw, inst, case["requests"], case["input_len"])
        detail = pt.to_dict()
        value = getattr(pt, metric)
    return {"value": value, "detail": detail}


def validate(hardware_file: str | None = None) -> dict:
    """One JSON-able object: rows with `published` and `predicted` in the same unit."""
    table = load_cases()
    db = HardwareDB(hardware_file)
    tol = float(table["tolerance"])
    rows = []
    for case in table["cases"]:
        pred = predict(case, db)
        pub = float(case["published"]["value"])
        err = (pred["value"] - pub) / pub
        rows.append({"id": case["id"], "what": case["what"], "unit": case["published"]["metric"],
                     "published": pub, "predicted": round(pred["value"], 1),
                     "error_pct": round(100 * err, 1), "within_tolerance": abs(err) <= tol,
                     "detail": pred["detail"]})
    return {"tolerance_pct": 100 * tol, "all_within": all(r["within_tolerance"] for r in rows),
            "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"{'case':<24} {'unit':<11} {'published':>10} {'predicted':>10} {'error':>8}  ok"]
    for r in result["rows"]:
        ok = "yes" if r["within_tolerance"] else "NO"
        lines.append(f"{r['id']:<24} {r['unit']:<11} {r['published']:>10.1f} {r['predicted']:>10.1f} "
                     f"{r['error_pct']:>+7.1f}%  {ok}")
    lines.append(f"tolerance +-{result['tolerance_pct']:.0f}%; all within: {result['all_within']}")
    return "\n".join(lines)
