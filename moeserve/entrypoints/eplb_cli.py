"""`moeserve eplb STATS... --ep-size W`: a balanced --expert-placement from --expert-load-stats files.

Reads the per-layer expert loads a run recorded (one file per rank, summed), replicates hot experts into
the --num-redundant-experts slots and packs every layer's slots over W EP ranks (layers/moe/eplb.py), writes
the placement JSON the engine's --expert-placement reads, and reports each layer's max/mean rank load with
the default contiguous placement and with the balanced one (the figure `moeserve plan <subcommand> --eplb-stats` uses).
"""
from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("eplb", help="balanced expert placement from recorded expert loads",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stats", nargs="+", help="--expert-load-stats file(s) (PATH, or PATH.rank0 PATH.rank1 ...)")
    p.add_argument("--ep-size", type=int, required=True, help="EP ranks the experts are placed on (D x T)")
    p.add_argument("--num-redundant-experts", type=int, default=0, help="extra slots for hot-expert replicas")
    p.add_argument("-o", "--output", help="write the placement JSON here (engine: --expert-placement)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def plan_placement(loads_by_layer: dict[int, list[float]], ep_size: int, redundant: int) -> dict:
    from moeserve.layers.moe.eplb import imbalance, rebalance
    from moeserve.layers.moe.placement import default_map

    if ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {ep_size}")
    if redundant < 0:
        raise ValueError(f"--num-redundant-experts must be >= 0, got {redundant}")
    layers, report = {}, {}
    for layer, loads in sorted(loads_by_layer.items()):
        n = len(loads)
        if (n + redundant) % ep_size:
            raise ValueError(f"{n} experts + --num-redundant-experts {redundant} do not split over --ep-size "
                             f"{ep_size}; choose the redundant count so the sum is a multiple of {ep_size}")
        phys = rebalance(loads, redundant, ep_size)
        layers[str(layer)] = phys
        row = {"balanced": round(imbalance(phys, loads, ep_size), 4)}
        if n % ep_size == 0 and redundant % ep_size == 0:
            row["default"] = round(imbalance(default_map(n, redundant, ep_size), loads, ep_size), 4)
        report[str(layer)] = row
    mean = lambda key: (round(sum(r[key] for r in report.values()) / len(report), 4)
                        if report and all(key in r for r in report.values()) else None)
    return {"placement": {"layers": layers}, "max_over_mean": report,
            "mean_max_over_mean": {"default": mean("default"), "balanced": mean("balanced")}}


def run(args) -> int:
    from moeserve.layers.moe.load_stats import read_loads

    loads = read_loads(args.stats)
    if -1 in loads:
        raise ValueError("these statistics have no layer numbers (a plain list of counts); the engine's "
                         "--expert-placement needs per-layer maps: record with --expert-load-stats")
    res = plan_placement(loads, args.ep_size, args.num_redundant_experts)
    if args.output:
        try:
            with open(args.output, "w") as f:
                json.dump(res["placement"], f)
        except OSError as e:
            raise ValueError(f"-o/--output {args.output!r} cannot be written ({e.strerror})") from None
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "placement" or not args.output}))
        return 0
    m = res["mean_max_over_mean"]
    print(f"{len(res['max_over_mean'])} MoE layers over {args.ep_size} EP ranks, "
          f"{args.num_redundant_experts} redundant slots: max/mean rank load "
          f"{m['default'] if m['default'] is not None else '-'} (default placement) -> {m['balanced']} (balanced)")
    for layer, row in res["max_over_mean"].items():
        print(f"  layer {layer:>3}: {row.get('default', '-')} -> {row['balanced']}")
    if args.output:
        print(f"wrote {args.output} (serve with --expert-placement {args.output}"
              f"{' --num-redundant-experts ' + str(args.num_redundant_experts) if args.num_redundant_experts else ''})",
              file=sys.stderr)
    return 0
