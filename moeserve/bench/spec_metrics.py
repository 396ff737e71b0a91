"""Speculative-decoding and prefix-cache figures of a benchmark run, from the server's /metrics before and
after it.

The engine counts cumulatively (vLLM's vllm:spec_decode_* counters and moeserve:spec_decode_num_draft_tokens_per_pos, see
entrypoints/metrics.py); the run's
share is the difference. acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted /
drafts (tokens per verification step, vLLM's definition); per-position acceptance = accepted at draft
position j / drafts verified at position j. Prefix-cache hit rate = hits / queries (prompt tokens) over the run.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:spec_decode_"
OWN_PREFIX = "moeserve:spec_decode_"  # moeserve's drafts-per-position counter, beside vLLM's
CACHE_PREFIX = "vllm:prefix_cache_"
SLO_PREFIX = "moeserve:slo_"


def scrape(base_url: str, headers: dict) -> dict[str, float]:
    """Spec-decode counter samples by (name, position); empty when the server has none or no /metrics."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:  # e.g. `moeserve proxy` or another OpenAI server: no Prometheus endpoint
        return {}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                prefix = next((p for p in (PREFIX, OWN_PREFIX) if s.name.startswith(p)), None)
                if prefix and s.name.endswith("_total"):
                    key = s.name[len(prefix):-len("_total")] + (f"@{s.labels['position']}"
                                                                if "position" in s.labels else "")
                    out[key] = out.get(key, 0.0) + s.value
                elif s.name.startswith(CACHE_PREFIX) and s.name.endswith("_total"):
                    key = s.name[len("vllm:"):-len("_total")]  # prefix_cache_queries / _hits
                    out[key] = out.get(key, 0.0) + s.value
                elif s.name.startswith(SLO_PREFIX) and s.name.endswith("_total"):
                    key = s.name[len("moeserve:"):-len("_total")]  # slo_met_requests, ...
                    out[key] = out.get(key, 0.0) + s.value
    except ValueError:  # not Prometheus text
        return {}
    return out


def spec_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's acceptance figures; {} when no drafts were verified during it."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts, tokens = d.get("num_drafts", 0.0), d.get("num_draft_tokens", 0.0)
    if tokens <= 0:
        return {}
    accepted = d.get("num_accepted_tokens", 0.0)
    positions = sorted(int(k.split("@")[1]) for k in d if k.startswith("num_draft_tokens_per_pos@"))
    per_pos = [d.get(f"num_accepted_tokens_per_pos@{j}", 0.0) / d[f"num_draft_tokens_per_pos@{j}"]
               if d[f"num_draft_tokens_per_pos@{j}"] else 0.0 for j in positions]
    return {"spec_decode_num_drafts": int(drafts), "spec_decode_num_draft_tokens": int(tokens),
            "spec_decode_num_accepted_tokens": int(accepted), "spec_decode_acceptance_rate": accepted / tokens,
            "spec_decode_mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
            "spec_decode_per_position_acceptance": per_pos,
            "spec_decode_accepted_tokens_per_pos": [int(d.get(f"num_accepted_tokens_per_pos@{j}", 0.0))
                                                    for j in positions]}


def cache_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's prefix-cache hit rate; {} when the server looked nothing up during it."""
    queries = after.get("prefix_cache_queries", 0.0) - before.get("prefix_cache_queries", 0.0)
    if queries <= 0:
        return {}
    hits = after.get("prefix_cache_hits", 0.0) - before.get("prefix_cache_hits", 0.0)
    return {"prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits), "prefix_cache_hit_rate": hits / queries}


def slo_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """The server's SLO-aware admission figures over the run (entrypoints/slo_metrics.py): requests with
    targets, met, turned away, and the relative error of the TTFT / TPOT it predicted at admission; {} when
    no request of the run had a target."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith("slo_")}
    n = d.get("slo_requests", 0.0)
    if n <= 0:
        return {}
    out = {"server_slo_requests": int(n), "server_slo_met": int(d.get("slo_met_requests", 0.0)),
           "server_slo_rejected": int(d.get("slo_rejected_requests", 0.0)),
           "server_slo_attainment": d.get("slo_met_requests", 0.0) / n}
    for k in ("ttft", "tpot"):
        measured = d.get(f"slo_{k}_measured_seconds", 0.0)
        if measured > 0:
            out[f"{k}_prediction_error"] = d.get(f"slo_{k}_prediction_error_seconds", 0.0) / measured
    return out
