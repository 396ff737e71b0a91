"""/metrics under vLLM's names, labels and buckets (read from vLLM 0.32's vllm/v1/metrics/loggers.py and
buckets.py), so dashboards, aiperf and vLLM-aware routers that scrape vLLM read moeserve unchanged."""
from __future__ import annotations

import httpx
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
}
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


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
    assert "moeserve:engine_alive" in fams  # moeserve's own beside vLLM's


def test_no_moeserve_duplicates_of_vllm_names(openai_server):
    """Each concept has one name: vLLM's where vLLM has it."""
    fams = _families(openai_server)
    ours = {n.split(":", 1)[1] for n in fams if n.startswith("moeserve:")}
    theirs = {n.split(":", 1)[1] for n in fams if n.startswith("vllm:")}
    assert not ours & theirs, ours & theirs
