"""`moeserve bench serve`: load a live OpenAI-compatible server and report vLLM-style serving figures.

Requests arrive as a Poisson process at --request-rate (inf: all at once), at most --max-concurrency in
flight; each one streams, so TTFT and inter-token latency are measured per chunk (see request.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime, timezone

import httpx
from tqdm import tqdm

from moeserve.bench import datasets
from moeserve.bench.metrics import LATENCIES, compute, latency_series
from moeserve.bench.spec_metrics import cache_figures, scrape, slo_figures, spec_figures
from moeserve.bench.request import RequestResult, send

STATS_SETTLE_S = 0.6  # a little over two engine stats heartbeats (engine/engine_core_proc.py HEARTBEAT_S)


async def _arrivals(n: int, rate: float, rng: random.Random, burstiness: float = 1.0):
    """Yield request indices at Poisson arrival times (exponential gaps of mean 1/rate); with burstiness b
    (vLLM's) the gaps are gamma(b, 1 / (rate b)): same mean rate, burstier below 1, steadier above."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate) if burstiness == 1.0 else
                                rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_requests(url: str, model: str, samples, rate: float, max_concurrency: int | None, seed: int,
                       extra: dict, headers: dict, progress: bool = True,
                       burstiness: float = 1.0) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=max_concurrency or len(samples), max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency or len(samples))
    bar = tqdm(total=len(samples), desc="bench serve", disable=not progress)
    rng = random.Random(seed)

    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits) as client:
        async def one(s) -> RequestResult:
            arrival = time.perf_counter()
            async with sem:
                r = await send(client, url, model, s.prompt, s.prompt_len, s.expected_output_len, extra, headers)
            r.queue_time = max(0.0, r.start - arrival)
            bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(samples), rate, rng, burstiness):
            tasks.append(asyncio.create_task(one(samples[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _tokenizer(args):
    """--tokenizer, else --model if it is a local folder, else the server's model root (/v1/models)."""
    from moeserve.tokenizer import load_tokenizer

    for cand in (args.tokenizer, args.model):
        if cand and os.path.isdir(cand):
            return load_tokenizer(cand)
    try:
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=_headers(args), timeout=10).json()
        root = next((m.get("root") for m in models["data"] if m["id"] == args.model), None)
    except (httpx.HTTPError, KeyError, ValueError):
        root = None
    if root and os.path.isdir(root):
        return load_tokenizer(root)
    raise ValueError("no tokenizer: pass --tokenizer PATH (a local folder with the model's tokenizer files)")


def _headers(args) -> dict:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **getattr(args, "headers", {})}


def _samples(args, tokenizer):
    if args.dataset == "random":
        return datasets.random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                        args.range_ratio, args.seed, args.random_prefix_len)
    if not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
    return datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts,
                                      args.output_len if args.output_len_given else None, args.seed)


def run(args) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.num_devices < 1:
        raise ValueError(f"--num-devices must be >= 1, got {args.num_devices}")
    from moeserve.bench import vllm_compat
    _wait_ready(args)
    started_at = datetime.now()
    tokenizer = _tokenizer(args)
    samples = _samples(args, tokenizer)
    url = args.base_url.rstrip("/") + args.endpoint
    extra = {**({"ignore_eos": True} if args.ignore_eos else {}), **vllm_compat.request_extra(args)}
    model = args.served_model_name or args.model
    if args.num_warmups:  # not measured: first-request costs (compilation, allocation) stay out of the figures
        asyncio.run(run_requests(url, model, samples[:args.num_warmups], float("inf"), args.max_concurrency,
                                 args.seed, extra, _headers(args), progress=False))
    # The engine's cumulative counters reach /metrics with its stats heartbeat (every 0.25 s): wait a couple
    # of beats before each scrape so that neither misses counts (a busy machine made the run's delta 0).
    time.sleep(STATS_SETTLE_S)
    spec_before = scrape(args.base_url, _headers(args))
    results, duration = asyncio.run(run_requests(url, model, samples, args.request_rate,
                                                 args.max_concurrency, args.seed, extra, _headers(args),
                                                 progress=not args.no_progress, burstiness=args.burstiness))
    for r in results:
        if r.success and not r.output_tokens:  # the server sent no usage: count with the tokenizer
            r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
    slos = {k: v for k, v in (("ttft", args.ttft_slo_ms), ("tpot", args.tpot_slo_ms),
                              ("e2el", args.e2el_slo_ms)) if v is not None}
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    m = compute(results, duration, args.num_devices, slos, percentiles)
    time.sleep(STATS_SETTLE_S)
    after = scrape(args.base_url, _headers(args))
    m.update(spec_figures(spec_before, after))
    m.update(cache_figures(spec_before, after))
    m.update(slo_figures(spec_before, after))
    print_report(m, percentiles, args.selected_metrics)
    if args.result_json:
        write_json(args, m, results)
    path = vllm_compat.result_path(args, started_at)
    if path:
        vllm_compat.save(args, vllm_compat.result_doc(args, m, results, started_at), path)
        print(f"result: {path}", file=sys.stderr)
    if args.plot:
        from moeserve.bench.plot import plot_latencies
        plot_latencies(latency_series([r for r in results if r.success]), args.plot, percentiles)
    if not m["completed"]:
        first = next((r.error for r in results if r.error), "no error text")
        print(f"moeserve bench: every request failed; the first error: {first}", file=sys.stderr)
        return 1
    return 0


def _wait_ready(args) -> None:
    """--ready-check-timeout-sec (vLLM's): poll /v1/models until the server answers."""
    deadline = time.monotonic() + args.ready_check_timeout_sec
    while args.ready_check_timeout_sec > 0:
        try:
            if httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=_headers(args), timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {args.base_url} did not answer within {args.ready_check_timeout_sec} s")
        time.sleep(1.0)


def print_report(m: dict, percentiles: list[float], metrics=LATENCIES) -> None:
    line = "=" * 50
    print(f"{line}\n{'Serving Benchmark Result':^50}\n{line}")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration_s"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Total token throughput (tok/s)", m["total_token_throughput"]),
            (f"Output tok/s per device ({m['num_devices']})", m["output_throughput_per_device"])]
    if m["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    for name in (n for n in LATENCIES if n in metrics):
        rows += [(f"Mean {name.upper()} (ms)", m[f"mean_{name}_ms"]),
                 (f"Median {name.upper()} (ms)", m[f"median_{name}_ms"])]
        rows += [(f"P{p:g} {name.upper()} (ms)", m[f"p{p:g}_{name}_ms"]) for p in percentiles]
    if "spec_decode_acceptance_rate" in m:
        rows += [("Spec decode acceptance rate", m["spec_decode_acceptance_rate"]),
                 ("Spec decode mean accepted length", m["spec_decode_mean_accepted_length"]),
                 ("Spec decode per-position acceptance",
                  " ".join(f"{a:.2f}" for a in m["spec_decode_per_position_acceptance"]))]
    if "prefix_cache_hit_rate" in m:
        rows.append(("Prefix cache hit rate", m["prefix_cache_hit_rate"]))
    if "server_slo_requests" in m:  # SLO-aware admission on the server
        rows += [("Server: turned away (503)", m["server_slo_rejected"]),
                 ("Server: SLO attainment", m["server_slo_attainment"])]
        rows += [(f"Server: {k.upper()} prediction error", m[f"{k}_prediction_error"])
                 for k in ("ttft", "tpot") if f"{k}_prediction_error" in m]
    for k, v in rows:
        print(f"{k:<36}{v:>14.2f}" if isinstance(v, float) else f"{k:<36}{v:>14}")
    print(line)


def write_json(args, m: dict, results: list[RequestResult]) -> None:
    ok = [r for r in results if r.success]
    doc = {"date": datetime.now(timezone.utc).isoformat(), "base_url": args.base_url, "endpoint": args.endpoint,
           "model": args.model, "dataset": args.dataset, "num_prompts": args.num_prompts,
           "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
           "max_concurrency": args.max_concurrency, "seed": args.seed, **m,
           "input_lens": [r.prompt_len for r in ok], "output_lens": [r.output_tokens for r in ok],
           "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok], "latencies": [r.latency for r in ok],
           "errors": [r.error for r in results if not r.success]}
    with open(args.result_json, "w") as f:
        json.dump(doc, f, indent=1)
