"""`moeserve plan validate`: predicted vs published for the cases in data/published.yaml.

The cases only choose layouts; every efficiency factor is the shared one from hardware.yaml. `predicted`
uses the default (end_to_end) profile; each row also carries `predicted_kernel`, the kernel-level-only
model, so the effect of the serving factor stays visible. `unlisted` holds sanity checks against other
published deployments (DeepSeek's own H800 figures); they are reported, not part of `all_within`.
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


def _rows(cases: list, db: HardwareDB, kernel_db: HardwareDB, tol: float) -> list[dict]:
    rows = []
    for case in cases:
        pred = predict(case, db)
        pub = float(case["published"]["value"])
        err = (pred["value"] - pub) / pub
        kern = predict(case, kernel_db)["value"]
        rows.append({"id": case["id"], "what": case["what"], "unit": case["published"]["metric"],
                     "published": pub, "predicted": round(pred["value"], 1),
                     "error_pct": round(100 * err, 1), "within_tolerance": abs(err) <= tol,
                     "predicted_kernel": round(kern, 1),
                     "error_kernel_pct": round(100 * (kern - pub) / pub, 1),
                     "detail": pred["detail"]})
    return rows


def validate(hardware_file: str | None = None, profile: str | None = None) -> dict:
    """One JSON-able object: rows with `published` and `predicted` in the same unit."""
    table = load_cases()
    db = HardwareDB(hardware_file, profile)
    kernel_db = HardwareDB(hardware_file, "kernel")
    tol = float(table["tolerance"])
    rows = _rows(table["cases"], db, kernel_db, tol)
    unlisted = _rows(table.get("unlisted") or [], db, kernel_db, tol)
    return {"tolerance_pct": 100 * tol, "efficiency_profile": db.profile,
            "serving_factor": db.get(table["cases"][0]["hardware"]).eff.serving,
            "all_within": all(r["within_tolerance"] for r in rows), "rows": rows,
            "unlisted": unlisted}


def format_table(result: dict) -> str:
    head = (f"{'case':<24} {'unit':<11} {'published':>10} {'predicted':>10} {'error':>8}  ok   "
            f"{'kernel-only':>11} {'error':>8}")

    def line(r, ok):
        return (f"{r['id']:<24} {r['unit']:<11} {r['published']:>10.1f} {r['predicted']:>10.1f} "
                f"{r['error_pct']:>+7.1f}%  {ok:<4} {r['predicted_kernel']:>11.1f} {r['error_kernel_pct']:>+7.1f}%")
    lines = [f"efficiency profile: {result['efficiency_profile']} (serving factor {result['serving_factor']})",
             head]
    lines += [line(r, "yes" if r["within_tolerance"] else "NO") for r in result["rows"]]
    lines.append(f"tolerance +-{result['tolerance_pct']:.0f}%; all within: {result['all_within']}")
    if result.get("unlisted"):
        lines.append("unlisted sanity checks (reference figures are approximate, not part of the tolerance):")
        lines += [line(r, "-") for r in result["unlisted"]]
    return "\n".join(lines)
