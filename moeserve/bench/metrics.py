"""Benchmark figures from per-request results, with `vllm bench serve`'s definitions.

TPOT per request = (latency - TTFT) / (output tokens - 1), for requests with more than one output token.
ITL = every gap between consecutive text chunks. E2EL = latency. Goodput = requests per second that meet
every SLO given (TTFT, TPOT, E2EL, in ms). All latency figures are reported in milliseconds.
"""
from __future__ import annotations

import numpy as np

from moeserve.bench.request import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def per_request_tpot(r: RequestResult) -> float | None:
    if r.output_tokens > 1:
        return (r.latency - r.ttft) / (r.output_tokens - 1)
    return None


def _summary(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    v = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(v.mean()) if v.size else 0.0,
           f"median_{name}_ms": float(np.median(v)) if v.size else 0.0,
           f"std_{name}_ms": float(v.std()) if v.size else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p)) if v.size else 0.0
    return out


def is_good(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": per_request_tpot(r) or 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def compute(results: list[RequestResult], duration: float, num_devices: int, slos_ms: dict[str, float],
            percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {"duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "output_throughput_per_device": total_out / duration / num_devices, "num_devices": num_devices,
         "request_goodput": (sum(is_good(r, slos_ms) for r in ok) / duration) if slos_ms else None,
         "slos_ms": slos_ms}
    series = latency_series(ok)
    for name in LATENCIES:
        m.update(_summary(name, series[name], percentiles))
    return m


def latency_series(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds: one TTFT/TPOT/E2EL per request, every ITL gap of every request."""
    return {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := per_request_tpot(r)) is not None],
            "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok]}
