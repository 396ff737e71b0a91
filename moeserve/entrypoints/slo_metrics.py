"""Prometheus metrics of SLO-aware admission (engine/slo.py), from the engine's cumulative EngineStats.slo_*.

Goodput is rate(moeserve:slo_met_requests_total[...]): requests per second that finished inside every
target they had. Attainment = met / requests (turned-away requests count as missed). The prediction error
of TTFT (TPOT) over any window is the increase of moeserve:slo_ttft_prediction_error_seconds_total over
that of moeserve:slo_ttft_measured_seconds_total: summed |predicted - measured| / summed measured, of
admitted requests as predicted at admission. The step-time model's mean per-step error is a gauge.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from moeserve.protocol import EngineStats


class SLOMetrics:
    COUNTERS = {"slo_requests": ("moeserve:slo_requests", "Requests with a TTFT/TPOT target that finished or "
                                 "were turned away"),
                "slo_met": ("moeserve:slo_met_requests", "Requests that finished inside every target (goodput)"),
                "slo_rejected": ("moeserve:slo_rejected_requests", "Requests turned away (503) because their "
                                 "TTFT target could not be met"),
                "slo_ttft_error_s": ("moeserve:slo_ttft_prediction_error_seconds", "Summed |predicted - "
                                     "measured| TTFT of admitted requests"),
                "slo_ttft_measured_s": ("moeserve:slo_ttft_measured_seconds", "Summed measured TTFT of the same"),
                "slo_tpot_error_s": ("moeserve:slo_tpot_prediction_error_seconds", "Summed |predicted - "
                                     "measured| TPOT of admitted requests"),
                "slo_tpot_measured_s": ("moeserve:slo_tpot_measured_seconds", "Summed measured TPOT of the same")}

    def __init__(self, model_name: str) -> None:
        lab = {"model_name": model_name}
        self.counters = {f: Counter(n, d, ["model_name"]).labels(**lab) for f, (n, d) in self.COUNTERS.items()}
        self._seen = dict.fromkeys(self.COUNTERS, 0)  # the engine counts from its start

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], multiprocess_mode="mostrecent").labels(**lab)
        self.attainment = gauge("moeserve:slo_attainment", "Met / all requests with a target, since start")
        self.step_error = gauge("moeserve:step_time_prediction_error",
                                "Mean relative error of the step-time model's per-step prediction")

    def update(self, s: EngineStats) -> None:
        for f, counter in self.counters.items():
            value = getattr(s, f)
            if value > self._seen[f]:
                counter.inc(value - self._seen[f])
                self._seen[f] = value
        if s.slo_requests:
            self.attainment.set(s.slo_met / s.slo_requests)
        self.step_error.set(s.step_time_error)
