"""Planner calibration figure: predicted vs published, plus throughput-vs-TPOT curves with the published
points marked.

Usage: python benchmarks/plan_validate.py [--out plan_validate.png] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from moeserve.planner.analysis import decode_curve
    from moeserve.planner.calibrate import format_table, load_cases, validate
    from moeserve.planner.deploy import Instance, Workload
    from moeserve.planner.hardware import HardwareDB
    from moeserve.planner.models import load_model
    from moeserve.planner.plots import plot_curves

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="plan_validate.png")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = validate()
    db, m = HardwareDB(), load_model("deepseek-v3")
    curves, marks = {}, []
    for case in load_cases()["cases"]:
        if case["kind"] != "decode":
            continue
        inst, wl = Instance(**case["instance"]), Workload(**case["workload"])
        curves[case["id"]] = decode_curve(m, db.get(case["hardware"]), inst, wl)
        marks.append((case["tpot_ms"], case["published"]["value"], f"published {case['id']}"))
    plot_curves(curves, args.out, published=marks)
    print(json.dumps(res, indent=2) if args.json else format_table(res) + f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
