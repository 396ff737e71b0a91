"""PD disaggregation over HTTP: `moeserve proxy` over a prefill and a decode server, against unified servers.

Starts real servers on the bundled model (or --model): unified (one engine process), unified DP2 + EP (two
engine processes, the same process count as PD), and PD (a prefill server, a decode server, the proxy),
runs the same `moeserve bench serve` stream (random prompts, Poisson arrivals) against each and prints
TTFT / TPOT / ITL percentiles and output throughput, with ratios against the first. Long prompts arriving
while others decode are what PD separates: a unified engine's decode steps carry prefill chunks (ITL
spikes), a PD decode engine's never do. Prints figures, never passes or fails.

Usage: python benchmarks/pd_serving.py [--input-len 512] [--output-len 64] [--num-prompts 40] [--rate 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _start(args: list[str], pattern: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env={**ENV, **(env or {})})
    for line in proc.stderr:
        m = re.search(pattern, line)
        if m:
            subprocess.Popen(["cat"], stdin=proc.stderr, stdout=subprocess.DEVNULL)  # keep draining stderr
            return proc, m.group(1)
    raise RuntimeError(f"{' '.join(args[:2])} did not start")


def serve(model: list[str], *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    return _start(["serve", *model, "--port", "0", "--log-level", "warning", *extra], r"ready on (http://\S+)", env)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def bench(url: str, a) -> dict:
    name = next(iter(json.loads(subprocess.check_output(["curl", "-s", url + "/v1/models"]))["data"]))["id"]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "moeserve.cli", "bench", "serve", "--base-url", url, "--model", name,
                        "--dataset", "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                        "--num-prompts", str(a.num_prompts), "--request-rate", str(a.rate), "--ignore-eos",
                        "--seed", "0", "--metric-percentiles", "50,99", "--result-json", f.name, "--no-progress"],
                       check=True, env=ENV, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--rate", type=float, default=2.0)
    a = ap.parse_args()
    model = [a.model] if a.model else []
    # the deployment secret (disagg/trust.py), in the environment the servers and the proxy inherit
    ENV.setdefault("MOESERVE_KV_SECRET", secrets.token_hex(16))
    kv = lambda role: ["--kv-transfer-config", json.dumps({"kv_connector": "nixl", "kv_role": role})]  # noqa: E731
    setups = {"unified": lambda: [serve(model)],
              "unified DP2+EP": lambda: [serve(model, "--data-parallel-size", "2", "--enable-expert-parallel")],
              "PD 1P+1D": None}
    rows = {}
    for label, start in setups.items():
        if start is None:  # PD: two servers and the proxy in front
            # Each engine gets its share of the cores, as the DP2 setup's ranks do (on one machine two
            # engines at all cores each oversubscribe it: TTFT p50 1987 ms instead of the figures in docs).
            share = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
            pre, dec = serve(model, *kv("kv_producer"), env=share), serve(model, *kv("kv_consumer"), env=share)
            proxy = _start(["proxy", "--port", "0", "--log-level", "warning", "--prefill", pre[1],
                            "--decode", dec[1]], r"proxy ready on (http://\S+)")
            started = [proxy, dec, pre]
        else:
            started = start()
        print(f"{label}: serving at {started[0][1]}, benchmarking", file=sys.stderr, flush=True)
        try:
            rows[label] = bench(started[0][1], a)
        finally:
            stop([p for p, _ in started])
    keys = [("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"),
            ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"), ("output_throughput", "out tok/s")]
    base = rows["unified"]
    print(f"{a.num_prompts} prompts of {a.input_len} tokens, {a.output_len} out, {a.rate} req/s Poisson")
    print(f"{'setup':>16} " + " ".join(f"{h:>10}" for _, h in keys))
    for label, r in rows.items():
        print(f"{label:>16} " + " ".join(f"{r[k]:>10.1f}" for k, _ in keys))
        if label != "unified":
            print(f"{'  / unified':>16} " + " ".join(f"{r[k] / base[k]:>10.2f}" for k, _ in keys))


if __name__ == "__main__":
    main()
