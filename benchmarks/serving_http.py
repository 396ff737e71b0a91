"""HTTP-layer throughput of `moeserve serve`: --api-server-count 1 vs 2, very short outputs, high concurrency.

For each API-server count the script starts a real server (the bundled model unless --model), drives it
from --client-procs load-generator processes (asyncio + httpx, --concurrency requests in flight in total,
non-streaming) for --duration seconds after a warm-up, and prints requests/s and latency, then the ratio
against the first count, for two workloads:
  generate  /v1/completions with max_tokens 1 (HTTP + tokenize + engine round trip + detokenize);
  http      /v1/completions naming an unknown model (parse, validate, 400 answer: the HTTP layer alone).
The offline LLM on the same generate workload (batches of --concurrency) is the engine's ceiling.
With --bench-serve it also runs `moeserve bench serve` on the first server and prints its figures.

    PYTHONPATH=. python benchmarks/serving_http.py --counts 1,2 --concurrency 128 --duration 15 --bench-serve
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(model: str | None, count: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", *([model] if model else []), "--port", "0",
           "--api-server-count", str(count), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        m = re.search(r"ready on (http://\S+) \(model '([^']+)'", line)
        if m:
            return proc, m.group(1), m.group(2)
        sys.stderr.write(line)
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _load(url: str, body: dict, concurrency: int, warmup: float, duration: float) -> list[float]:
    latencies: list[float] = []
    t0 = time.perf_counter()
    t_start, t_end = t0 + warmup, t0 + warmup + duration
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker():
            while (now := time.perf_counter()) < t_end:
                r = await client.post(url + "/v1/completions", json=body)
                if r.status_code != (400 if body["model"] == BAD_MODEL else 200):
                    raise RuntimeError(f"unexpected answer {r.status_code}: {r.text[:200]}")
                done = time.perf_counter()
                if now >= t_start:
                    latencies.append(done - now)
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return latencies


def _client_proc(url, body, concurrency, warmup, duration, queue) -> None:
    queue.put(asyncio.run(_load(url, body, concurrency, warmup, duration)))


BAD_MODEL = "no-such-model"


def measure(url: str, model: str, workload: str, concurrency: int, procs: int, warmup: float,
            duration: float) -> dict:
    body = {"model": model if workload == "generate" else BAD_MODEL, "prompt": "hi", "max_tokens": 1,
            "temperature": 0.0}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_client_proc, args=(url, body, concurrency // procs, warmup, duration, q))
          for _ in range(procs)]
    for p in ps:
        p.start()
    lat = [x for _ in ps for x in q.get()]
    for p in ps:
        p.join()
    lat.sort()
    return {"requests": len(lat), "req_per_s": len(lat) / duration, "p50_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3}


def bench_serve(url: str, model: str, args) -> None:
    cmd = [sys.executable, "-m", "moeserve.cli", "bench", "serve", "--base-url", url, "--model", model,
           "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate, "--ignore-eos",
           "--max-concurrency", str(args.max_concurrency), "--no-progress", "--seed", "0"]
    if args.result_json:
        cmd += ["--result-json", args.result_json]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ROOT})


def offline_ceiling(model: str | None, batch: int, rounds: int = 3) -> float:
    """Requests/s of the offline LLM on the generate workload: what the engine alone sustains."""
    from moeserve import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False)  # the same prompts run again: measure compute, not the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(["hi"] * batch, params)  # warm-up
    start = time.perf_counter()
    for _ in range(rounds):
        llm.generate(["hi"] * batch, params)
    rate = rounds * batch / (time.perf_counter() - start)
    del llm
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--counts", default="1,2", help="API-server counts to compare")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--server-args", default="--max-num-seqs 256", help="extra `moeserve serve` flags")
    ap.add_argument("--bench-serve", action="store_true", help="also run `moeserve bench serve` (first count)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    print(f"cpus={os.cpu_count()} concurrency={args.concurrency} client_procs={args.client_procs} "
          f"duration={args.duration}s max_tokens=1")
    offline = offline_ceiling(args.model, args.concurrency)
    print(f"offline LLM, batches of {args.concurrency} x max_tokens 1: {offline:.1f} req/s", flush=True)
    results: dict[tuple[str, int], dict] = {}
    for i, count in enumerate(counts):
        proc, url, model = start_server(args.model, count, args.server_args.split())
        try:
            for workload in ("generate", "http"):
                results[workload, count] = r = measure(url, model, workload, args.concurrency, args.client_procs,
                                                       args.warmup, args.duration)
                print(f"{workload:8s} api-server-count {count}: {r['req_per_s']:.1f} req/s  p50 {r['p50_ms']:.1f} "
                      f"ms  p99 {r['p99_ms']:.1f} ms  ({r['requests']} requests)", flush=True)
            if args.bench_serve and i == 0:
                bench_serve(url, model, args)
        finally:
            stop_server(proc)
    for workload in ("generate", "http"):
        base = results[workload, counts[0]]["req_per_s"]
        for count in counts[1:]:
            print(f"{workload:8s} ratio api-server-count {count} / {counts[0]}: "
                  f"{results[workload, count]['req_per_s'] / base:.2f}x")
        if workload == "generate":
            for count in counts:
                print(f"generate api-server-count {count} / offline LLM: "
                      f"{results[workload, count]['req_per_s'] / offline:.2f}x")


if __name__ == "__main__":
    main()
