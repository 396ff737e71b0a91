"""Prometheus metrics of SLO-aware admission (engine/slo.py), from the engine's cumulative EngineStats.slo_*.

Goodput is rate(moeserve:slo_met_requests_total[...]): requests per second that finished inside every
target they had. Attainment = met / requests (turned-away requests count as missed). The prediction errors
are relative: summed |predicted - measured| over summed measured, TTFT and TPOT of admitted requests as
predicted at admission, and the step-time model's mean per-step error.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from moeserve.protocol import EngineStats


class SLOMetrics:
    COUNTERS = {"slo_requests": ("moeserve:slo_requests", "Requests with a TTFT/TPOT target that finished or "
                                 "were turned away"),
                "slo_met": ("moeserve:slo_met_requests", "Requests that finished inside every target (goodput)"),
                "slo_rejected": ("moeserve:slo_rejected_requests", "Requests turned away (503) because their "
                                 "TTFT target could not be met")}

    def __init__(self, model_name: str) -> None:
        lab = {"model_name": model_name}
        self.counters = {f: Counter(n, d, ["model_name"]).labels(**lab) for f, (n, d) in self.COUNTERS.items()}
        self._seen = dict.fromkeys(self.COUNTERS, 0)  # the engine counts from its start

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], multiprocess_mode="mostrecent").labels(**lab)
        self.attainment = gauge("moeserve:slo_attainment", "Met / all requests with a target, since start")
        self.ttft_error = gauge("moeserve:slo_ttft_prediction_error",
                                "Relative error of the TTFT predicted at admission")
        self.tpot_error = gauge("moeserve:slo_tpot_prediction_error",
                                "Relative error of the TPOT predicted at admission")
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
        if s.slo_ttft_measured_s:
            self.ttft_error.set(s.slo_ttft_error_s / s.slo_ttft_measured_s)
        if s.slo_tpot_measured_s:
            self.tpot_error.set(s.slo_tpot_error_s / s.slo_tpot_measured_s)
        self.step_error.set(s.step_time_error)
