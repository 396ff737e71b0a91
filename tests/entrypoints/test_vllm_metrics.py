"""/metrics under vLLM's names, labels and buckets (read from vLLM 0.32's vllm/v1/metrics/loggers.py and
buckets.py), so dashboards, aiperf and vLLM-aware routers that scrape vLLM read moeserve unchanged."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# name -> prometheus type, as vLLM exposes them (families, without _total/_bucket suffixes)
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prompt_tokens_cached": "counter", "vllm:prompt_tokens_by_source": "counter",
    "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:request_num_preemptions": "histogram",
}
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


# captured from vLLM 0.32: CacheConfig(block_size=16).metrics_info().keys()
VLLM_CACHE_INFO_KEYS = (
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "effective_attention_block_size",
    "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved")


def _families(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _buckets(family) -> list[float]:
    return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})


def _sum(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_names_labels_and_buckets(openai_server, client, model):
    before = _families(openai_server)
    n_before = _sum(before["vllm:request_queue_time_seconds"], "_count")
    it_before = _sum(before["vllm:iteration_tokens_total"], "_sum")
    r = client.completions.create(model=model, prompt=["one two three", "four five"], max_tokens=6,
                                  temperature=0, extra_body={"ignore_eos": True})
    fams = _families(openai_server)
    for name, kind in VLLM_METRICS.items():
        assert name in fams, f"{name} missing from /metrics"
        assert fams[name].type == kind, (name, fams[name].type)
        for s in fams[name].samples:
            if name == "vllm:cache_config_info":  # vLLM's labels it with the config alone (and engine)
                continue
            assert s.labels.get("model_name") == model and s.labels.get("engine") == "0", (name, s.labels)
    assert _buckets(fams["vllm:time_to_first_token_seconds"]) == TTFT_BUCKETS
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert _buckets(fams[f"vllm:{name}"]) == LATENCY_BUCKETS, name
    # request tokens: 1-2-5 up to --max-model-len 256
    assert _buckets(fams["vllm:request_prompt_tokens"]) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert _sum(fams["vllm:request_queue_time_seconds"], "_count") - n_before == 2
    assert _sum(fams["vllm:request_success"], "_total", finished_reason="length") >= 2
    # phases add up: inference = prefill + decode, each inside e2e
    inf, pre, dec = (_sum(fams[f"vllm:request_{p}_time_seconds"], "_sum") for p in ("inference", "prefill", "decode"))
    assert abs(inf - (pre + dec)) < 1e-6 and inf <= _sum(fams["vllm:e2e_request_latency_seconds"], "_sum")
    # every generated token of the two requests was in some engine step
    assert _sum(fams["vllm:iteration_tokens_total"], "_sum") - it_before >= r.usage.completion_tokens
    info = [s.labels for s in fams["vllm:cache_config_info"].samples]
    assert info and info[0]["block_size"] == "16" and int(info[0]["num_gpu_blocks"]) > 0
    # vLLM's 36 CacheConfig labels (its CacheConfig(block_size=16).metrics_info() keys), and engine
    assert set(info[0]) == set(VLLM_CACHE_INFO_KEYS) | {"engine"} and len(VLLM_CACHE_INFO_KEYS) == 36
    assert int(info[0]["kv_cache_size_tokens"]) == 16 * int(info[0]["num_gpu_blocks"])
    assert float(info[0]["kv_cache_max_concurrency"]) == pytest.approx(int(info[0]["kv_cache_size_tokens"]) / 256,
                                                                       abs=0.01)
    assert "moeserve:engine_alive" in fams  # moeserve's own beside vLLM's


def test_no_moeserve_duplicates_of_vllm_names(openai_server):
    """Each concept has one name: vLLM's where vLLM has it."""
    fams = _families(openai_server)
    ours = {n.split(":", 1)[1] for n in fams if n.startswith("moeserve:")}
    theirs = {n.split(":", 1)[1] for n in fams if n.startswith("vllm:")}
    assert not ours & theirs, ours & theirs


def test_vllm_metrics_moeserve_lacked(openai_server, client, model):
    """The metrics vLLM always exports that moeserve lacked (issue 33), with vLLM's labels and meaning."""
    before = _families(openai_server)
    assert before["vllm:engine_sleep_state"].type == "gauge"
    sleep = {s.labels["sleep_state"]: s.value for s in before["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert {s.labels["source"] for s in before["vllm:prompt_tokens_cached_by_source"].samples
            if s.name.endswith("_total")} == {"device", "host", "p2p", "disk", "external_unspecified"}
    assert {s.labels["reason"] for s in before["vllm:admission_rejections"].samples if s.name.endswith("_total")} \
        >= {"max_num_queued_reqs", "max_num_queued_tokens"}
    by_reason = {s.labels["reason"]: s.value for s in before["vllm:num_requests_waiting_by_reason"].samples}
    assert set(by_reason) == {"capacity", "deferred"}
    assert sum(by_reason.values()) == _sum(before["vllm:num_requests_waiting"])
    cached0 = _sum(before["vllm:prompt_tokens_cached_by_source"], "_total", source="device")
    count0 = _sum(before["vllm:request_max_num_generation_tokens"], "_count")
    total0 = _sum(before["vllm:request_max_num_generation_tokens"], "_sum")
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    # n=2 samples of one prompt, both to max_tokens: one observation of the larger count (vLLM's, per request)
    client.completions.create(model=model, prompt=prompt, max_tokens=5, n=2, temperature=1.0, seed=3,
                              extra_body={"ignore_eos": True})
    again = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    fams = _families(openai_server)
    assert _sum(fams["vllm:request_max_num_generation_tokens"], "_count") - count0 == 2
    assert _sum(fams["vllm:request_max_num_generation_tokens"], "_sum") - total0 == 5 + 3
    assert _buckets(fams["vllm:request_max_num_generation_tokens"]) == [1, 2, 5, 10, 20, 50, 100, 200]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert _sum(fams["vllm:prompt_tokens_cached_by_source"], "_total", source="device") - cached0 >= cached
    for s in fams["vllm:request_max_num_generation_tokens"].samples:
        assert s.labels.get("model_name") == model and s.labels.get("engine") == "0"


def test_admission_rejections_count_the_queue_bound(ckpt_dir):
    """--max-num-queued-reqs 1 and four requests at once: those that come while another is in flight get a
    503, each counted by vLLM's vllm:admission_rejections{reason="max_num_queued_reqs"}."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.entrypoints.server import ServerProcess
    server = ServerProcess(ckpt_dir("v3"), "--max-num-queued-reqs", "1", "--max-num-seqs", "1", "--max-model-len",
                           "512", "--dtype", "float32", "--served-model-name", "m")
    try:
        body = {"model": "m", "prompt": "x", "max_tokens": 100, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(server.base_url + "/completions", json=body, timeout=120),
                                    range(4)))
        refused = [r for r in answers if r.status_code == 503]
        assert refused and all(r.status_code in (200, 503) for r in answers)
        assert all("--max-num-queued-reqs" in r.json()["error"]["message"] for r in refused)
        assert server.wait_metric("vllm:admission_rejections_total", lambda v: v == len(refused)) == len(refused)
        assert server.metric("vllm:admission_rejections_total", reason="max_num_queued_reqs") == len(refused)
        assert server.metric("vllm:admission_rejections_total", reason="max_num_queued_tokens") == 0
    finally:
        server.stop()


def test_http_metrics_from_the_instrumentator(openai_server, client, model):
    """vLLM's http_* metrics (prometheus-fastapi-instrumentator), summed over both API servers, probes excluded."""
    pytest.importorskip("prometheus_fastapi_instrumentator")
    before = _families(openai_server)
    n0 = _sum(before["http_requests"], "_total", handler="/v1/completions", status="2xx") \
        if "http_requests" in before else 0.0
    for _ in range(3):
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    httpx.get(openai_server.url + "/health", timeout=10)
    fams = _families(openai_server)
    for name, kind in (("http_requests", "counter"), ("http_request_duration_seconds", "histogram"),
                       ("http_request_duration_highr_seconds", "histogram"), ("http_request_size_bytes", "summary"),
                       ("http_response_size_bytes", "summary")):
        assert name in fams and fams[name].type == kind, name
    assert _sum(fams["http_requests"], "_total", handler="/v1/completions", method="POST", status="2xx") - n0 == 3
    assert not [s for s in fams["http_requests"].samples if s.labels.get("handler") in ("/health", "/metrics")]


def test_grafana_dashboard_queries_name_exported_metrics(openai_server, client, model):
    """moeserve/entrypoints/grafana_dashboard.json: every metric its queries (and its model_name variable) name
    is a sample /metrics exports, with the labels the queries group by."""
    import importlib.util
    import json
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), "..", "..", "moeserve", "entrypoints", "grafana_dashboard.json")
    dash = json.load(open(path))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 30
    client.completions.create(model=model, prompt="hello there", max_tokens=2)
    httpx.post(openai_server.base_url + "/completions", json={"model": "nope", "prompt": "x"}, timeout=10)  # a 400
    text = httpx.get(openai_server.url + "/metrics", timeout=10).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    has_http = importlib.util.find_spec("prometheus_fastapi_instrumentator") is not None
    named = set()
    for expr in exprs:
        for name in re.findall(r"\b(?:vllm:|moeserve:|http_)[A-Za-z0-9_:]+", expr):
            if name.startswith("http_") and not has_http:
                continue
            named.add(name)
            assert name in samples, f"{name} (in {expr!r}) is not exported"
        for label in re.findall(r"by\s*\(([^)]*)\)", expr):
            for lbl in (x.strip() for x in label.split(",")):
                if lbl != "le":
                    assert any(lbl in s.labels for n, s in samples.items() if n in expr), (lbl, expr)
    assert {"vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_waiting_by_reason",
            "vllm:request_max_num_generation_tokens_bucket"} <= named


def test_request_num_preemptions_counts_each_requests_preemptions(ckpt_dir):
    """A KV pool too small for four long requests at once: the scheduler preempts (by recompute); every
    finished request lands in vllm:request_num_preemptions (vLLM's buckets), and the per-request counts add up
    to the engine's vllm:num_preemptions."""
    import concurrent.futures

    from tests.entrypoints.server import ServerProcess

    server = ServerProcess(ckpt_dir("v3"), "--num-gpu-blocks-override", "12", "--block-size", "16",
                           "--max-model-len", "256", "--dtype", "float32", "--served-model-name", "m")
    try:
        def run(i: int) -> None:
            r = httpx.post(server.base_url + "/completions", timeout=300, json={
                "model": "m", "prompt": f"request {i} " + "word " * 30, "max_tokens": 100, "ignore_eos": True})
            assert r.status_code == 200, r.text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(run, range(4)))
        fams = _families(server)
        hist = fams["vllm:request_num_preemptions"]
        assert hist.type == "histogram"
        assert _buckets(hist) == [1, 2, 3, 4, 5, 10, 20]
        assert _sum(hist, "_count") == 4
        total = _sum(fams["vllm:num_preemptions"], "_total")
        assert total > 0, "the pool was meant to force preemptions"
        assert _sum(hist, "_sum") == total
    finally:
        server.stop()
