"""Goodput under overload: plain FCFS vs SLO-aware admission (engine/slo.py), in one script run.

Two real servers on the same model and flags, one with --slo-ttft-ms / --slo-tpot-ms (admission), one
without (FCFS: admission is inert for requests without targets). The script
  1. measures capacity: `moeserve bench serve` on the FCFS server with every request at once
     (request throughput, req/s; "thr" columns: completed requests per second of each run);
  2. picks targets (unless given): TTFT 3x (at least 0.5 s) and TPOT 1.5x the medians of a run at half
     capacity;
  3. per repeat, measures capacity again (the machine's load drifts), then runs `moeserve bench serve` at 2x
     that (Poisson, same seed) against each server, alternating which goes first, and prints goodput (requests/s inside both targets, bench serve's figure), the ratio
     admission / FCFS per repeat, and the server's TTFT / TPOT prediction error (|predicted - measured| /
     measured, summed over admitted requests) and turned-away count.
Speed figures on a shared CPU are noisy: compare the ratios of one run, and the repeats' spread.

    PYTHONPATH=. python benchmarks/slo_admission.py --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.serving_http import start_server, stop_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(url: str, model: str, args, rate: float, n: int, slo: tuple[float, float] | None, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "moeserve.cli", "bench", "serve", "--base-url", url, "--model", model,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed), "--no-progress",
           "--result-json", path]
    if slo:
        cmd += ["--ttft-slo-ms", f"{slo[0]:.1f}", "--tpot-slo-ms", f"{slo[1]:.1f}"]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"bench serve failed:\n{out.stderr[-2000:]}")
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=100, help="requests per overload run")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--overload", type=float, default=2.0, help="request rate as a multiple of capacity")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    # one thread per process: on a shared 2-core machine a second OpenMP thread stalls at every barrier
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512", "--log-level", "warning"]

    fcfs, url, model = start_server(args.model, 1, engine)
    adm = None
    try:
        cap = bench(url, model, args, float("inf"), args.num_prompts // 2, None, 1)["request_throughput"]
        slo = (args.ttft_slo_ms, args.tpot_slo_ms)
        if None in slo:
            light = bench(url, model, args, cap / 2, max(20, args.num_prompts // 4), None, 2)
            slo = (args.ttft_slo_ms or max(500.0, 3 * light["median_ttft_ms"]),
                   args.tpot_slo_ms or 1.5 * light["median_tpot_ms"])
        print(f"targets TTFT {slo[0]:.0f} ms, TPOT {slo[1]:.1f} ms; {args.num_prompts} requests per run at "
              f"{args.overload:g}x the capacity measured (FCFS, all at once) just before each repeat", flush=True)
        adm, adm_url, _ = start_server(args.model, 1, engine + ["--slo-ttft-ms", f"{slo[0]:.1f}",
                                                                "--slo-tpot-ms", f"{slo[1]:.1f}"])
        bench(adm_url, model, args, float("inf"), 8, None, 3)  # warm-up + first calibration steps
        print(f"{'repeat':>6} {'cap req/s':>9} {'FCFS goodput':>13} {'adm goodput':>12} {'ratio':>6} "
              f"{'FCFS thr':>9} {'adm thr':>8} {'turned away':>12} {'TTFT pred err':>14} {'TPOT pred err':>14} "
              f"{'FCFS p50 TTFT':>14} {'adm p50 TTFT':>13}", flush=True)
        for r in range(args.repeats):
            cap = bench(url, model, args, float("inf"), args.num_prompts // 2, None, 100 + r)["request_throughput"]
            rate = args.overload * cap
            # alternate which server goes first, so a drift in the machine's load favours neither
            order = [("fcfs", url), ("adm", adm_url)] if r % 2 == 0 else [("adm", adm_url), ("fcfs", url)]
            res = {name: bench(u, model, args, rate, args.num_prompts, slo, 10 + r) for name, u in order}
            base, ours = res["fcfs"], res["adm"]
            ratio = ours["request_goodput"] / base["request_goodput"] if base["request_goodput"] else float("inf")
            print(f"{r:>6} {cap:>9.2f} {base['request_goodput']:>13.2f} {ours['request_goodput']:>12.2f} "
                  f"{ratio:>6.2f} {base['request_throughput']:>9.2f} {ours['request_throughput']:>8.2f} "
                  f"{ours.get('server_slo_rejected', 0):>12} {ours.get('ttft_prediction_error', float('nan')):>14.2f} "
                  f"{ours.get('tpot_prediction_error', float('nan')):>14.2f} {base['median_ttft_ms']:>14.0f} "
                  f"{ours['median_ttft_ms']:>13.0f}", flush=True)
    finally:
        if adm is not None:
            stop_server(adm)
        stop_server(fcfs)


if __name__ == "__main__":
    main()
