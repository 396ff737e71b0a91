"""Faults under load, as an operator would cause them: does every request in flight survive, and when is the
service back? (issue 31)

For each scenario the script starts a real `moeserve serve` (the bundled model unless --model), runs
--streams greedy completion streams once without a fault (the reference), then again, and once every stream
has streamed --before events it injects the fault:
  kill9-core  kill -9 of the engine core (one engine process);
  kill9-rank  kill -9 of DP rank 1 (--data-parallel-size 2 --enable-expert-parallel);
  stop-rank   kill -STOP of DP rank 1 (the same), declared dead after --engine-stall-timeout.
It prints per scenario and repeat: streams failed (an error event or no [DONE]), outputs identical to the
reference (text, finish reason, token count), seconds from the fault until /health is 200 again (after it
was seen 503), the longest silence a stream saw across the fault (its largest gap between two events), and
seconds from the fault until the last stream ended. A second unfailed run checks the reference itself is
reproducible (greedy output can depend on the batch's make-up in low precision: --dtype float32 by default).

    PYTHONPATH=. python benchmarks/fault_recovery.py --scenarios kill9-core,kill9-rank,stop-rank --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = re.compile(r"ready on (http://\S+) \(model '([^']+)'.*engine core pid (\d+)")
BACK = re.compile(r"the engine core is back \(pid (\d+)\)")
DP = ["--data-parallel-size", "2", "--enable-expert-parallel"]
SCENARIOS = {"kill9-core": ([], "core", signal.SIGKILL), "kill9-rank": (DP, "rank", signal.SIGKILL),
             "stop-rank": (DP, "rank", signal.SIGSTOP)}


class Server:
    """A `moeserve serve` process; its stderr is read on a thread (the launcher logs each restart's pid)."""

    def __init__(self, model: str | None, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", *([model] if model else []), "--port", "0", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(600) or self.proc.poll() is not None:
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.url, self.model, self.core_pid = m.group(1), m.group(2), int(m.group(3))
                self.ready.set()
            m = BACK.search(line)
            if m:
                self.core_pid = int(m.group(1))
        self.ready.set()

    def rank_pid(self, index: int) -> int:
        """The pid of the core's index-th child (its DP ranks, in start order)."""
        out = subprocess.run(["pgrep", "-P", str(self.core_pid)], capture_output=True, text=True).stdout.split()
        return sorted(int(p) for p in out)[index]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prompts(n: int) -> list[str]:
    words = ["The", "capital", "of", "France", "once", "upon", "a", "time", "def", "f(x):", "zebra", "moeserve"]
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + i % 5)) for i in range(n)]


def stream(url: str, body: dict, events: list) -> None:
    """events: (perf_counter, event) per SSE event, event being the decoded JSON or "[DONE]"."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                events.append((time.perf_counter(), {"error": r.read().decode()}))
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append((time.perf_counter(), data if data == "[DONE]" else json.loads(data)))
    except httpx.HTTPError as e:
        events.append((time.perf_counter(), {"error": repr(e)}))


def answer(events: list) -> tuple:
    chunks = [e for _, e in events if isinstance(e, dict) and e.get("choices")]
    usage = next((e["usage"] for _, e in events if isinstance(e, dict) and e.get("usage")), None)
    return ("".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"] if chunks
            else None, usage and usage["completion_tokens"])


def run(server: Server, args, fault=None) -> tuple[list[list], dict]:
    bodies = [{"model": server.model, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}} for p in prompts(args.streams)]
    events: list[list] = [[] for _ in bodies]
    threads = [threading.Thread(target=stream, args=(server.url, b, ev)) for b, ev in zip(bodies, events)]
    for t in threads:
        t.start()
    times: dict = {}
    if fault is not None:
        while not all(len(ev) >= args.before for ev in events):
            if not any(t.is_alive() for t in threads):
                raise RuntimeError("the streams ended before the fault; raise --max-tokens")
            time.sleep(0.005)
        fault()
        times["fault"] = t0 = time.perf_counter()
        seen_down = False
        while time.perf_counter() - t0 < args.timeout:
            try:
                up = httpx.get(server.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                up = False
            seen_down = seen_down or not up
            if seen_down and up:
                times["health"] = time.perf_counter() - t0
                break
            time.sleep(0.05)
    for t in threads:
        t.join(args.timeout)
    return events, times


def scenario(name: str, args) -> list[dict]:
    extra, target, sig = SCENARIOS[name]
    server = Server(args.model, ["--max-model-len", str(args.max_model_len), "--engine-stall-timeout",
                                 str(args.stall_timeout), "--engine-restart-backoff", str(args.backoff),
                                 "--dtype", args.dtype, *args.serve_args.split(), *extra])
    stopped: list[int] = []
    rows = []
    try:
        reference, _ = run(server, args)
        want = [answer(ev) for ev in reference]
        again = sum(1 for ev, w in zip(run(server, args)[0], want) if answer(ev) == w)
        print(f"{name:<11} unfailed run again: {again}/{len(want)} identical to the reference", flush=True)
        for repeat in range(args.repeats):
            pid = server.core_pid if target == "core" else server.rank_pid(1)
            if sig == signal.SIGSTOP:
                stopped.append(pid)
            events, times = run(server, args, lambda: (os.kill(pid, sig), server.lines.append(
                f"{time.strftime('%Y-%m-%d %H:%M:%S')},{int(time.time() % 1 * 1000):03d} fault: signal {sig.name} "
                f"sent to pid {pid}\n")))
            t0 = times["fault"]
            failed = sum(1 for ev in events if not ev or ev[-1][1] != "[DONE]"
                         or any(isinstance(e, dict) and "error" in e for _, e in ev))
            identical = sum(1 for ev, w in zip(events, want) if answer(ev) == w)
            gaps = [b[0] - a[0] for ev in events for a, b in zip(ev, ev[1:])]
            rows.append({"scenario": name, "repeat": repeat, "streams": len(events), "failed": failed,
                         "identical": identical, "health_back_s": times.get("health"),
                         "max_gap_s": max(gaps) if gaps else None,
                         "last_done_s": max(ev[-1][0] for ev in events if ev) - t0})
            print(fmt(rows[-1]), flush=True)
            time.sleep(1.0)  # the restarted engine settles (the stall timer restarts) before the next fault
    finally:
        server.stop()
        if args.log:
            with open(args.log, "a") as f:
                f.write(f"==== {name}\n" + "".join(server.lines))
        for pid in stopped:  # the stopped rank of each repeat lingers until it can see its SIGTERM
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return rows


HEADER = f"{'scenario':<11} {'repeat':>6} {'streams':>7} {'failed':>6} {'identical':>9} {'health back s':>13} " \
         f"{'max gap s':>9} {'all done s':>10}"


def fmt(r: dict) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f}"
    return (f"{r['scenario']:<11} {r['repeat']:>6} {r['streams']:>7} {r['failed']:>6} {r['identical']:>9} "
            f"{s(r['health_back_s']):>13} {s(r['max_gap_s']):>9} {s(r['last_done_s']):>10}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--scenarios", default="kill9-core,kill9-rank,stop-rank", help="comma-separated: "
                   + ", ".join(SCENARIOS))
    p.add_argument("--streams", type=int, default=16, help="greedy streams in flight at the fault (16)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream (128)")
    p.add_argument("--before", type=int, default=4, help="events every stream has had before the fault (4)")
    p.add_argument("--repeats", type=int, default=1, help="faults per scenario, on the same server (1)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--stall-timeout", type=float, default=5.0, help="--engine-stall-timeout (5)")
    p.add_argument("--backoff", type=float, default=1.0, help="--engine-restart-backoff (1)")
    p.add_argument("--dtype", default="float32", help="--dtype of the server (float32)")
    p.add_argument("--serve-args", default="", help="more `moeserve serve` flags, e.g. '--enforce-eager'")
    p.add_argument("--log", default=None, help="append each scenario's server log (stderr) to this file")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a repeat may take before it counts as lost")
    args = p.parse_args()
    print(HEADER, flush=True)
    rows = [r for name in args.scenarios.split(",") for r in scenario(name, args)]
    print("\nsummary (per scenario: streams failed / in flight, outputs identical, max seconds until /health 200)")
    for name in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == name]
        backs = [r["health_back_s"] for r in rs if r["health_back_s"] is not None]
        back = f"back within {max(backs):.2f} s" if len(backs) == len(rs) else "not back after a fault"
        print(f"  {name:<11} failed {sum(r['failed'] for r in rs)}/{sum(r['streams'] for r in rs)}, identical "
              f"{sum(r['identical'] for r in rs)}/{sum(r['streams'] for r in rs)}, {back}")


if __name__ == "__main__":
    main()
