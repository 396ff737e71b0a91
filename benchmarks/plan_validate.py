"""Planner calibration figure: predicted vs published, plus throughput-vs-TPOT curves with the published
points marked. With --assumptions: `validate --feasibility` for each choice the sources leave open (the
Atlas 800I A2's 910B compute bin), to show what that choice, not the efficiency factors, does to the best
worst-case error.

Usage: python benchmarks/plan_validate.py [--out plan_validate.png] [--json] [--assumptions [--points N]]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assumptions(points: int) -> list[dict]:
    """Feasibility over the documented efficiency ranges for each 910B compute bin the Atlas 800I A2 may
    carry (hardware.md: which one the published runs used is not stated); the layouts are the published
    Omni-Infer ones."""
    from moeserve.planner.calibrate import feasibility, load_cases
    out = []
    for device in ("910b", "910b3"):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "a2.yaml")
            with open(path, "w") as f:
                f.write(f"systems:\n  atlas-800i-a2: {{device: {device}, scale_up_domain: 8, scale_up_gbps: 196, "
                        f"scale_out_gbps: 25}}\n")
            cases = copy.deepcopy(load_cases()["cases"])
            res = feasibility(path, points=points, cases=cases)
            out.append({"a2_device": device, **res})
    return out


def main() -> None:
    from moeserve.planner.analysis import decode_curve
    from moeserve.planner.calibrate import format_table, load_cases, validate
    from moeserve.perf.deploy import Instance, Workload
    from moeserve.perf.hardware import HardwareDB
    from moeserve.perf.models import load_model
    from moeserve.planner.plots import plot_curves

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="plan_validate.png")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--assumptions", action="store_true", help="feasibility for each open layout choice")
    ap.add_argument("--points", type=int, default=3, help="grid values per factor for --assumptions")
    args = ap.parse_args()
    if args.points < 2:
        ap.error(f"--points must be >= 2 (both ends of each range), got {args.points}")
    if args.assumptions:
        rows = assumptions(args.points)
        if args.json:
            print(json.dumps(rows, indent=2))
            return
        print(f"{'A2 device':<10} {'best worst error':>17}  rows there")
        for r in rows:
            errs = ", ".join(f"{v:+.1f}" for v in r["best_errors_pct"].values())
            print(f"{r['a2_device']:<10} {r['best_max_abs_error_pct']:>16.1f}%  {errs}")
        return
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
