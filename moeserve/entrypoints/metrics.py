"""Prometheus metrics of the API servers (prometheus-client, multiprocess mode).

With several API-server processes each one writes its own counters and histograms to files in
PROMETHEUS_MULTIPROC_DIR (the launcher sets it before any server starts) and /metrics in any of them sums
them up. Engine-wide gauges (running, waiting, KV usage) come from the engine core's stats, which every
API server receives; they use the "mostrecent" mode so the freshest report wins instead of being summed.
The engine's cumulative counts (preemptions, prefix-cache queries and hits, speculative-decoding drafts and
acceptances) are turned into counter increments by API server 0 only.
Names follow vLLM's (vllm:... -> moeserve:...).
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from moeserve.entrypoints.slo_metrics import SLOMetrics
from moeserve.protocol import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServerMetrics:
    def __init__(self, model_name: str, client_index: int = 0) -> None:
        self.client_index = client_index
        self._preemptions_seen: int | None = None
        m = {"labelnames": ["model_name"]}

        def labelled(metric):
            return metric.labels(model_name=model_name)

        self.requests = Counter("moeserve:request_success", "Finished requests by outcome (stop, length, "
                                "abort = client gone, error = rejected)", ["model_name", "outcome"])
        self._requests_by = {o: self.requests.labels(model_name=model_name, outcome=o)
                             for o in ("stop", "length", "abort", "error")}
        self.http_errors = Counter("moeserve:http_errors", "HTTP requests answered with an error",
                                   ["model_name", "status"])
        self._model = model_name
        self.prompt_tokens = labelled(Counter("moeserve:prompt_tokens", "Prefilled prompt tokens", **m))
        self.generation_tokens = labelled(Counter("moeserve:generation_tokens", "Generated tokens", **m))
        self.preemptions = labelled(Counter("moeserve:num_preemptions", "Preempted requests (engine)", **m))
        self.spec = SpecDecodeMetrics(model_name)
        self.slo = SLOMetrics(model_name)
        # Prefix caching in prompt tokens (vLLM's prefix_cache_queries / _hits): hit rate = hits / queries.
        self.prefix_cache = {f: labelled(Counter(f"moeserve:{f}", d, **m)) for f, d in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"))}
        self._prefix_seen = dict.fromkeys(self.prefix_cache, 0)  # the engine counts from its start
        gauge = {"multiprocess_mode": "mostrecent", **m}
        self.running = labelled(Gauge("moeserve:num_requests_running", "Requests in the running batch", **gauge))
        self.waiting = labelled(Gauge("moeserve:num_requests_waiting", "Requests waiting to run", **gauge))
        self.kv_usage = labelled(Gauge("moeserve:kv_cache_usage_perc", "Fraction of KV blocks in use", **gauge))
        self.engine_alive = labelled(Gauge("moeserve:engine_alive", "1 while the engine core answers", **gauge))
        self.ttft = labelled(Histogram("moeserve:time_to_first_token_seconds", "Time to first token", **m,
                                       buckets=LATENCY_BUCKETS))
        self.tpot = labelled(Histogram("moeserve:request_time_per_output_token_seconds",
                                       "Per request: (last token - first token) / (output tokens - 1)", **m,
                                       buckets=LATENCY_BUCKETS))
        self.itl = labelled(Histogram("moeserve:inter_token_latency_seconds", "Time between token batches", **m,
                                      buckets=LATENCY_BUCKETS))
        self.e2e = labelled(Histogram("moeserve:e2e_request_latency_seconds", "Arrival to last token", **m,
                                      buckets=LATENCY_BUCKETS))
        self.out_len = labelled(Histogram("moeserve:request_generation_tokens", "Output tokens per request", **m,
                                          buckets=TOKEN_BUCKETS))
        self.engine_alive.set(1)

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if self.client_index == 0:
            if self._preemptions_seen is not None and stats.num_preemptions > self._preemptions_seen:
                self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
            for f, counter in self.prefix_cache.items():
                value = getattr(stats, f)
                if value > self._prefix_seen[f]:
                    counter.inc(value - self._prefix_seen[f])
                    self._prefix_seen[f] = value
            self.spec.update(stats)
            self.slo.update(stats)

    def observe_finished(self, st, outcome: str) -> None:
        """st: the engine client's per-request timing record (_Stream)."""
        import time

        self._requests_by.get(outcome, self._requests_by["error"]).inc()
        if outcome == "error":
            return
        self.prompt_tokens.inc(st.prompt_len)
        self.generation_tokens.inc(st.num_tokens)
        self.out_len.observe(st.num_tokens)
        self.e2e.observe(time.perf_counter() - st.arrival)
        if st.num_tokens > 1 and st.first is not None:
            self.tpot.observe((st.last - st.first) / (st.num_tokens - 1))

    def http_error(self, status: int) -> None:
        self.http_errors.labels(model_name=self._model, status=str(status)).inc()


class SpecDecodeMetrics:
    """vLLM's spec-decode counters from the engine's cumulative EngineStats.spec_* fields.

    acceptance rate = accepted_tokens / draft_tokens; mean accepted length = 1 + accepted_tokens / drafts;
    per-position acceptance = accepted_tokens_per_pos{position=j} / drafts reaching position j.
    """

    def __init__(self, model_name: str) -> None:
        self._seen: dict[str, int] = {}  # the engine counts from its start, as these counters do
        lab = {"model_name": model_name}
        names = {"spec_num_drafts": ("moeserve:spec_decode_num_drafts", "Request-steps that verified drafts"),
                 "spec_num_draft_tokens": ("moeserve:spec_decode_num_draft_tokens", "Draft tokens verified"),
                 "spec_num_accepted_tokens": ("moeserve:spec_decode_num_accepted_tokens", "Draft tokens accepted")}
        self.totals = {f: Counter(n, d, ["model_name"]).labels(**lab) for f, (n, d) in names.items()}
        self.per_pos = Counter("moeserve:spec_decode_num_accepted_tokens_per_pos",
                               "Drafts accepted at each draft position", ["model_name", "position"])
        self.drafts_per_pos = Counter("moeserve:spec_decode_num_draft_tokens_per_pos",
                                      "Drafts verified at each draft position", ["model_name", "position"])
        self._model = model_name

    def update(self, stats: EngineStats) -> None:
        now = {f: getattr(stats, f) for f in self.totals}
        for j, (a, d) in enumerate(zip(stats.spec_accepted_per_position, stats.spec_drafts_per_position)):
            now[f"acc{j}"], now[f"drafts{j}"] = a, d
        for key, value in now.items():
            delta = value - self._seen.get(key, 0)
            if delta > 0:
                self._counter(key).inc(delta)
        self._seen = now

    def _counter(self, key: str):
        if key in self.totals:
            return self.totals[key]
        metric = self.per_pos if key.startswith("acc") else self.drafts_per_pos
        return metric.labels(model_name=self._model, position=key.lstrip("acdrfts"))


def render() -> bytes:
    """Text exposition of every API server's metrics (summed over the multiprocess directory)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
