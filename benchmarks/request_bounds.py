"""A 16 MB prompt against `moeserve serve`: how long until it is refused, how much the API server grows, and
how long other requests on that API server wait meanwhile (issue 19 item 2).

    PYTHONPATH=. python benchmarks/request_bounds.py                      # this tree
    git archive BASE | tar -x -C /tmp/base                                # the tree before the bounds
    PYTHONPATH=. python benchmarks/request_bounds.py --baseline /tmp/base # both, in one run: the ratios

One API server, the tiny checkpoint, --max-model-len 256. A probe thread sends small completions
(max_tokens 1) back to back for the whole run; "probe worst" is the slowest of them while the big request
was in flight, "probe median" the usual one. Peak RSS is the API server's VmHWM after the request.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

READY = re.compile(r"ready on (http://\S+) .*API server pids ([\d,]+)")


def start(source: str, model: str) -> tuple[subprocess.Popen, str, int]:
    env = {**os.environ, "PYTHONPATH": source}
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", model, "--port", "0", "--max-model-len", "256",
           "--dtype", "float32", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=source)
    for line in proc.stderr:
        m = READY.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), int(m.group(2).split(",")[0])
    raise RuntimeError(f"the server from {source} did not start")


def rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(source: str, model: str, size_mb: float) -> dict:
    proc, url, api_pid = start(source, model)
    try:
        client = httpx.Client(timeout=600)
        small = {"prompt": "hello", "max_tokens": 1}
        for _ in range(3):
            client.post(url + "/v1/completions", json=small)
        before = rss_mb(api_pid, "VmRSS")
        probes: list[tuple[float, float]] = []  # (start, seconds)
        stop = threading.Event()

        def probe():
            with httpx.Client(timeout=600) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    c.post(url + "/v1/completions", json=small)
                    probes.append((t, time.monotonic() - t))
                    time.sleep(0.05)
        th = threading.Thread(target=probe, daemon=True)
        th.start()
        time.sleep(1.0)
        body = b'{"prompt": "' + b"x" * int(size_mb * 1e6) + b'", "max_tokens": 1}'
        t0 = time.monotonic()
        r = client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        t1 = time.monotonic()
        time.sleep(1.0)
        stop.set()
        th.join(60)
        during = [d for s, d in probes if t0 - d <= s <= t1] or [0.0]
        return {"status": r.status_code, "code": r.json().get("error", {}).get("code"), "refused_s": t1 - t0,
                "rss_before_mb": before, "rss_peak_mb": rss_mb(api_pid, "VmHWM"), "probe_worst_s": max(during),
                "probe_median_s": statistics.median(d for _, d in probes)}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="a source tree to compare with (run first)")
    ap.add_argument("--size-mb", type=float, default=16.0)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from tests.checkpoints import write_checkpoint
    trees = ([("baseline", args.baseline)] if args.baseline else []) + [("this tree", here)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model = write_checkpoint(os.path.join(d, "tiny"), "v3")
        for i in range(args.repeat):
            for name, src in trees:
                rows.append((name, i, measure(src, model, args.size_mb)))
    print(f"{args.size_mb:g} MB prompt, --max-model-len 256, one API server")
    print(f"{'tree':<10} {'run':>3} {'status':>6} {'code':<24} {'refused in':>10} {'RSS before':>10} "
          f"{'RSS peak':>9} {'probe worst':>11} {'probe median':>12}")
    for name, i, m in rows:
        print(f"{name:<10} {i:>3} {m['status']:>6} {str(m['code']):<24} {m['refused_s']:>9.2f}s "
              f"{m['rss_before_mb']:>8.0f}MB {m['rss_peak_mb']:>7.0f}MB {m['probe_worst_s']:>10.2f}s "
              f"{m['probe_median_s']:>11.3f}s")
    if args.baseline:
        for i in range(args.repeat):
            base = next(m for n, j, m in rows if n == "baseline" and j == i)
            new = next(m for n, j, m in rows if n == "this tree" and j == i)
            print(f"run {i}: time to refusal {base['refused_s'] / new['refused_s']:.0f}x shorter, peak RSS growth "
                  f"{(base['rss_peak_mb'] - base['rss_before_mb']) / max(1.0, new['rss_peak_mb'] - new['rss_before_mb']):.0f}x "
                  f"smaller, worst probe {base['probe_worst_s'] / new['probe_worst_s']:.0f}x shorter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
