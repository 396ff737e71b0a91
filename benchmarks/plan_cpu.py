"""CPU check of the planner: predicted vs measured decode step times of moeserve's CPU engine.

Usage: python benchmarks/plan_cpu.py [--batches 1,4,16] [--threads 1] [--eager] [--json]
Same as `moeserve plan profile-cpu --measure`: the compiled decode step (the engine's default), or the eager
one with --eager; prints ratios, never passes or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from moeserve.planner.cpucheck import format_report, run_check

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="the eager decode step instead of the compiled one")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run_check([int(b) for b in a.batches.split(",")], measure=True, threads=a.threads, eager=a.eager)
    print(json.dumps(res, indent=2) if a.json else format_report(res))


if __name__ == "__main__":
    main()
