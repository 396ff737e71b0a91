"""Prometheus metrics of the API servers (prometheus-client, multiprocess mode), under vLLM's names.

Everything vLLM also measures carries vLLM's name, labels (model_name, engine) and buckets, so vLLM's
Grafana dashboards, aiperf and vLLM-aware routers read moeserve unchanged; what only moeserve has sits
beside them with the `moeserve:` prefix (engine_alive, http_errors, spec-decode drafts per position).

With several API-server processes each one writes its own counters and histograms to files in
PROMETHEUS_MULTIPROC_DIR (the launcher sets it before any server starts) and /metrics in any of them sums
them up. Engine-wide gauges (running, waiting, KV usage) come from the engine core's stats, which every
API server receives; they use the "mostrecent" mode so the freshest report wins instead of being summed.
The engine's cumulative counts (preemptions, prefix-cache queries and hits, speculative-decoding drafts and
acceptances) are turned into counter increments by API server 0 only. Per-request timings follow vLLM's
phases: queue = arrival in the engine -> first step, prefill = first step -> first token, decode = first
-> last token, inference = prefill + decode.
"""
from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from moeserve.entrypoints.slo_metrics import SLOMetrics
from moeserve.protocol import EngineStats

# vLLM's bucket families (vllm/v1/metrics/buckets.py), so histograms from both aggregate alike.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")  # vLLM's num_requests_waiting_by_reason
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's engine_sleep_state
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource
# vLLM's admission_rejections reasons, and moeserve's own bound (--max-waiting-requests)
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens", "max_waiting_requests")
NOT_RESUMED_REASONS = ("crash_limit", "disaggregated")  # moeserve:requests_not_resumed


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's request-token buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# vLLM 0.32's CacheConfig.metrics_info() keys, in its order, with vLLM's defaults: what moeserve does not have
# (Mamba state, sliding windows, offloading, layouts) reports the value vLLM reports for a model without it
VLLM_CACHE_INFO_DEFAULTS = {
    "block_size": "16", "user_specified_block_size": "True", "kv_cache_layout": "None", "prefix_match_unit": "None",
    "gpu_memory_utilization": "None", "cache_dtype": "auto", "is_attention_free": "False",
    "num_gpu_blocks_override": "None", "sliding_window": "None", "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
    "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16", "use_replayssm": "False",
    "use_kda_recoverssm": "False", "num_gpu_blocks": "None", "num_cpu_blocks": "None",
    "effective_attention_block_size": "None", "kv_cache_size_tokens": "None", "kv_cache_max_concurrency": "None",
    "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
    "kv_offloading_backend": "native", "_block_size_resolved": "True",
}


def cache_config_info(config) -> dict[str, str]:
    """The labels of vllm:cache_config_info from an EngineConfig: vLLM's 36 CacheConfig keys, moeserve's values
    where it has the setting (the pool's size in blocks is added when the engine is ready)."""
    c = config.cache
    return {**VLLM_CACHE_INFO_DEFAULTS, "block_size": str(c.block_size),
            "cache_dtype": getattr(c, "cache_dtype", "auto"), "enable_prefix_caching": str(c.enable_prefix_caching),
            "gpu_memory_utilization": str(c.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(c.kv_cache_memory), "num_gpu_blocks_override": str(c.num_kv_blocks),
            "effective_attention_block_size": str(c.block_size), "hash_block_size": str(c.block_size),
            "cache_hit_alignment_tokens": str(c.block_size), "num_cpu_blocks": "0"}


class ServerMetrics:
    def __init__(self, model_name: str, client_index: int = 0, max_model_len: int = 4096,
                 cache_info: dict | None = None) -> None:
        self.client_index = client_index
        self._model = model_name
        self._labels = {"model_name": model_name, "engine": "0"}  # one engine front (DP ranks summed)
        self._cache_info = {k: str(v) for k, v in (cache_info or {}).items()}
        self._max_model_len = max_model_len
        self._cache_config_gauge: Gauge | None = None
        names = list(self._labels)
        gauge = {"multiprocess_mode": "mostrecent", "labelnames": names}
        tokens = build_1_2_5_buckets(max_model_len)

        def counter(name, doc):
            return Counter(name, doc, names).labels(**self._labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets).labels(**self._labels)

        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             **gauge).labels(**self._labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             **gauge).labels(**self._labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              **gauge).labels(**self._labels)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            names + ["source"])
        self.prompt_by_source = {s: by_source.labels(**self._labels, source=s) for s in PROMPT_SOURCES}
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"])
        self._success = {r: success.labels(**self._labels, finished_reason=r) for r in FINISHED_REASONS}
        self.prefix_cache = {
            "prefix_cache_queries": counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_cache_hits": counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")}
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.out_len = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                 tokens)
        self.max_tokens_param = histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", tokens)
        self.n_param = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                 REQUEST_PARAMS_N_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.phases = {p: histogram(f"vllm:{n}", d, REQUEST_LATENCY_BUCKETS) for p, n, d in (
            ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("inference", "request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."))}
        self.prefill_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Histogram of new KV tokens computed during prefill "
                                          "(excluding cached tokens).", tokens)
        # vLLM's: waiting requests by reason (all wait for capacity here: nothing defers a request), the
        # engine's sleep state (`moeserve serve` never sleeps its engine: awake), cached prompt tokens by the
        # tier that held them (the KV pool: device), admission rejections by the bound that refused them, the
        # most tokens any of a request's n samples generated
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason "
                          "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
                          "constraints. Sum of all reasons equals vllm:num_requests_waiting.",
                          names + ["reason"], multiprocess_mode="mostrecent")
        self.waiting_by_reason = {r: by_reason.labels(**self._labels, reason=r) for r in WAITING_REASONS}
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
                      "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
                      "level 2.", names + ["sleep_state"], multiprocess_mode="mostrecent")
        for state in SLEEP_STATES:
            sleep.labels(**self._labels, sleep_state=state).set(1 if state == "awake" else 0)
        cached_by_source = Counter("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier "
                                   "that supplied them.", names + ["source"])
        self.cached_by_source = {s: cached_by_source.labels(**self._labels, source=s) for s in CACHE_HIT_SOURCES}
        rejections = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, "
                             "by reason.", ["model_name", "reason"])
        self.admission_rejections = {r: rejections.labels(model_name=model_name, reason=r) for r in ADMISSION_REASONS}
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Histogram of the number of times a request was preempted.",
                                             REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.spec = SpecDecodeMetrics(self._labels)
        # moeserve's own, beside vLLM's
        self.engine_alive = Gauge("moeserve:engine_alive", "1 while the engine core answers",
                                  **gauge).labels(**self._labels)
        self.http_errors = Counter("moeserve:http_errors", "HTTP requests answered with an error",
                                   ["model_name", "status"])
        # requests in flight when the engine core died (engine_client.py): resumed on the restarted core, the
        # time from the death seen here to their first output there, and those failed instead (reason:
        # crash_limit, MOESERVE_MAX_REQUEST_CRASHES; disaggregated, a PD request)
        self.requests_resumed = counter("moeserve:requests_resumed",
                                        "Requests in flight when the engine core died, resumed on its replacement")
        self.resume_latency = histogram("moeserve:request_resume_latency_seconds",
                                        "Seconds from the engine core's death to a resumed request's next output",
                                        TTFT_BUCKETS)
        not_resumed = Counter("moeserve:requests_not_resumed", "Requests in flight when the engine core died that "
                              "were failed instead of resumed", names + ["reason"])
        self.not_resumed = {r: not_resumed.labels(**self._labels, reason=r) for r in NOT_RESUMED_REASONS}
        # --enable-elastic-ep (engine/elastic.py): the engine rides through lost ranks
        self.elastic_degraded = Gauge("moeserve:elastic_ep_degraded", "Ranks lost and not replaced: the engine "
                                      "serves on the survivors while > 0", **gauge).labels(**self._labels)
        self.elastic_losses = counter("moeserve:elastic_ep_rank_losses", "Ranks lost while serving")
        self.elastic_recovery = histogram("moeserve:elastic_ep_recovery_seconds", "Seconds from a rank loss "
                                          "seen to the survivors serving again", REQUEST_LATENCY_BUCKETS)
        self.elastic_requeued = counter("moeserve:elastic_ep_requests_requeued",
                                        "Unfinished requests re-queued on the survivors after a rank loss (the lost rank's; "
                                        "the survivors keep theirs)")
        self.elastic_recomputed = counter("moeserve:elastic_ep_tokens_recomputed",
                                          "Tokens (prompt + output so far) the re-queued requests recompute")
        self._elastic_seen = EngineStats()
        self._preemptions_seen: int | None = None
        self.slo = SLOMetrics(model_name)
        self._prefix_seen = dict.fromkeys(self.prefix_cache, 0)  # the engine counts from its start
        self.engine_alive.set(1)

    def engine_ready(self, num_kv_blocks: int) -> None:
        """vllm:cache_config_info: a gauge at 1 whose labels are the cache configuration (as vLLM's)."""
        tokens = num_kv_blocks * int(self._cache_info.get("block_size", "16"))
        info = {**self._cache_info, "num_gpu_blocks": str(num_kv_blocks), "kv_cache_size_tokens": str(tokens),
                "kv_cache_max_concurrency": str(round(tokens / self._max_model_len, 2)), "engine": "0"}
        if self._cache_config_gauge is None:  # once per process: a restarted engine core is ready again
            self._cache_config_gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                             list(info), multiprocess_mode="mostrecent")
        self._cache_config_gauge.labels(**info).set(1)

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_by_reason["capacity"].set(stats.num_waiting)
        self.waiting_by_reason["deferred"].set(0)
        self.kv_usage.set(stats.kv_cache_usage)
        if self.client_index == 0:
            if self._preemptions_seen is not None and stats.num_preemptions > self._preemptions_seen:
                self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
            for f, c in self.prefix_cache.items():
                value = getattr(stats, f)
                if value > self._prefix_seen[f]:
                    c.inc(value - self._prefix_seen[f])
                    self._prefix_seen[f] = value
            self.spec.update(stats)
            self.slo.update(stats)
            self._update_elastic(stats)

    def _update_elastic(self, stats: EngineStats) -> None:
        seen = self._elastic_seen
        self.elastic_degraded.set(stats.elastic_ranks_lost - stats.elastic_ranks_replaced)
        for counter, f in ((self.elastic_losses, "elastic_ranks_lost"), (self.elastic_requeued, "elastic_requeued"),
                           (self.elastic_recomputed, "elastic_tokens_recomputed")):
            if getattr(stats, f) > getattr(seen, f):
                counter.inc(getattr(stats, f) - getattr(seen, f))
        if stats.elastic_recovery_s > seen.elastic_recovery_s:  # a re-formation finished since the last stats
            self.elastic_recovery.observe(stats.elastic_last_recovery_s)
        self._elastic_seen = stats

    def observe_request(self, params) -> None:
        """A request's sampling parameters as it arrives."""
        if params.max_tokens is not None:
            self.max_tokens_param.observe(params.max_tokens)
        self.n_param.observe(params.n)

    def observe_iteration(self, num_tokens: int) -> None:
        """Tokens one engine step computed for this server's requests (prompt tokens not cached + new ones)."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def observe_first_token(self, st) -> None:
        """st: the engine client's per-request record (_Stream) when its first tokens came."""
        self.ttft.observe(st.first - st.arrival)
        computed = st.prompt_len - st.num_cached
        self.prompt_tokens.inc(st.prompt_len)
        self.prompt_tokens_cached.inc(st.num_cached)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(st.num_cached)
        self.cached_by_source["device"].inc(st.num_cached)

    def observe_finished(self, st, outcome: str) -> None:
        """st: the engine client's per-request timing record (_Stream); outcome: stop, length, abort, error."""
        self._success.get(outcome, self._success["error"]).inc()
        if outcome == "error":
            return
        now = time.perf_counter()
        self.generation_tokens.inc(st.num_tokens)
        self.out_len.observe(st.num_tokens)
        self.prompt_len.observe(st.prompt_len)
        self.phases["e2e"].observe(now - st.arrival)
        self.request_preemptions.observe(st.num_preemptions)
        if st.first is None:  # aborted before its first token: it waited (or prefilled) all along
            return
        self.prefill_computed.observe(st.prompt_len - st.num_cached)
        prefill = max(0.0, st.first - st.arrival - st.queue_time)
        decode = st.last - st.first
        for phase, value in (("queue", st.queue_time), ("prefill", prefill), ("decode", decode),
                             ("inference", prefill + decode)):
            self.phases[phase].observe(value)
        self.tpot.observe(decode / (st.num_tokens - 1) if st.num_tokens > 1 else 0.0)

    def observe_resumed(self, seconds: float) -> None:
        """A request that outlived its engine core had its first output from the new one, seconds after the
        death was seen."""
        self.requests_resumed.inc()
        self.resume_latency.observe(seconds)

    def observe_max_generation(self, num_tokens: int) -> None:
        """A request (all its n samples) finished: the most tokens one of its samples generated (vLLM's)."""
        self.max_generation_tokens.observe(num_tokens)

    def admission_rejected(self, reason: str) -> None:
        """The engine core refused a request at a queue bound (reason: one of ADMISSION_REASONS)."""
        self.admission_rejections[reason].inc()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(model_name=self._model, status=str(status)).inc()


class SpecDecodeMetrics:
    """vLLM's spec-decode counters from the engine's cumulative EngineStats.spec_* fields.

    acceptance rate = accepted_tokens / draft_tokens; mean accepted length = 1 + accepted_tokens / drafts;
    per-position acceptance = accepted_tokens_per_pos{position=j} / drafts reaching position j (the latter
    is moeserve's: moeserve:spec_decode_num_draft_tokens_per_pos).
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self._seen: dict[str, int] = {}  # the engine counts from its start, as these counters do
        self._labels = labels
        names = list(labels)
        docs = {"spec_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")}
        self.totals = {f: Counter(n, d, names).labels(**labels) for f, (n, d) in docs.items()}
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               names + ["position"])
        self.drafts_per_pos = Counter("moeserve:spec_decode_num_draft_tokens_per_pos",
                                      "Drafts verified at each draft position", names + ["position"])

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
        return metric.labels(**self._labels, position=key.lstrip("acdrfts"))


def render() -> bytes:
    """Text exposition of every API server's metrics (summed over the multiprocess directory)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
