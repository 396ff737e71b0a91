"""bench serve's SLO figures: the run's share of the server's cumulative SLO counters."""
from moeserve.bench.spec_metrics import slo_figures


def test_run_share_of_the_counters():
    before = {"slo_requests": 10.0, "slo_met_requests": 8.0, "slo_rejected_requests": 1.0,
              "slo_ttft_prediction_error_seconds": 1.0, "slo_ttft_measured_seconds": 4.0}
    after = {"slo_requests": 30.0, "slo_met_requests": 18.0, "slo_rejected_requests": 6.0,
             "slo_ttft_prediction_error_seconds": 3.0, "slo_ttft_measured_seconds": 12.0,
             "slo_tpot_prediction_error_seconds": 0.5, "slo_tpot_measured_seconds": 2.0}
    got = slo_figures(before, after)
    assert got == {"server_slo_requests": 20, "server_slo_met": 10, "server_slo_rejected": 5,
                   "server_slo_attainment": 0.5, "ttft_prediction_error": 0.25, "tpot_prediction_error": 0.25}


def test_no_targets_in_the_run_gives_nothing():
    assert slo_figures({}, {}) == {}
    assert slo_figures({"slo_requests": 3.0}, {"slo_requests": 3.0}) == {}
