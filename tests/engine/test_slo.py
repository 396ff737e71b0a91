"""SLO-aware admission as a pure component: the step-time model's online fit, the admission and
rejection rules against hand-made batches, the target checks."""
import math

import numpy as np
import pytest

from moeserve.config import ConfigError, SchedulerConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.engine.scheduler import Scheduler
from moeserve.config import check_slo_ms
from moeserve.engine.slo import SLOAdmission
from moeserve.engine.step_time import StepFeatures, StepTimeModel, planner_prior
from moeserve.models.default import default_model_path
from moeserve.sampling_params import SamplingParams

TRUE = np.array([0.010, 0.002, 0.001, 0.050, 0.020])  # the "machine": seconds per feature unit


def _true_time(f: StepFeatures) -> float:
    return float(TRUE @ f.vector())


def test_online_fit_learns_a_machine_ten_times_off_the_prior():
    model = StepTimeModel(TRUE / 10)
    rng = np.random.default_rng(0)
    for _ in range(300):
        f = StepFeatures(rng.integers(0, 64), rng.integers(0, 64) * 300, rng.integers(0, 2) * rng.integers(1, 2048),
                         rng.integers(0, 2) * 1e5)
        model.observe(f, _true_time(f))
    probe = StepFeatures(16, 16 * 500, 256, 256 * 128)
    assert model.predict(probe) == pytest.approx(_true_time(probe), rel=0.03)
    assert model.calibrated and model.recent_error < 0.03


def test_outliers_are_bounded_and_bad_times_ignored():
    model = StepTimeModel(TRUE)
    f = StepFeatures(8, 8 * 100)
    model.observe(f, _true_time(f))  # warm-up step: not a sample
    before = model.predict(f)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        model.observe(f, bad)
    assert model.num_steps == 0 and model.predict(f) == before
    model.observe(f, 1000.0)  # one step slowed by something else on the machine
    assert model.predict(f) < 3.5 * before


def test_planner_prior_of_the_bundled_model_is_positive_and_finite():
    w = planner_prior(default_model_path())
    assert w.shape == (5,) and np.all(np.isfinite(w)) and np.all(w >= 0) and w[0] > 0


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 2e9, True, "100"])
def test_bad_targets_are_refused(value):
    with pytest.raises(ValueError, match="slo_ttft_ms must be a number of milliseconds"):
        check_slo_ms(value, "slo_ttft_ms")
    with pytest.raises(ConfigError, match="--slo-tpot-ms"):
        SchedulerConfig(slo_tpot_ms=value)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _policy(clock, ttft_ms=None, tpot_ms=None, budget=512):
    model = StepTimeModel(TRUE)
    model.num_steps = 100  # calibrated: the rules, not slow start, are under test
    return SLOAdmission(model, clock, budget, ttft_ms, tpot_ms)


def _req(i, prompt=100, max_tokens=50, t=0.0, **slo):
    return Request(f"r{i}", [5] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=t, **slo)


def _running(policy, n, prompt=100, out=10):
    reqs = []
    for i in range(n):
        r = _req(100 + i, prompt)
        r.output_token_ids = [1] * out
        r.num_computed_tokens = r.num_tokens - 1
        policy.track(r)
        reqs.append(r)
    return reqs


def test_admission_stops_at_the_batch_whose_tpot_breaks_the_target():
    clock = Clock()
    pol = _policy(clock, tpot_ms=60.0)
    running = _running(pol, 4)
    view = pol.begin(running)
    admitted = 0
    while pol.admits(_req(admitted), view):
        admitted += 1
    # the policy's own prediction says where the target breaks: the last admitted batch meets it,
    # one more would not
    assert pol.tpot(view.size, view.context) <= 0.060
    extra = _req(999)
    assert pol.tpot(view.size + 1, view.context + pol._mid_context(extra)) > 0.060
    assert admitted == view.size - 4 > 0


def test_requests_without_targets_still_respect_the_running_targets():
    clock = Clock()
    pol = _policy(clock)  # no defaults
    tight = _running(pol, 1)[0]
    tight.slo_tpot_ms = 1.0  # nothing but a lone request meets 1 ms
    pol._tracks.clear()
    view = pol.begin([tight])
    assert view.tightest_tpot_s == pytest.approx(0.001)
    assert not pol.admits(_req(1), view)
    # a lone request is admitted whatever its target (nothing would help it)
    assert pol.admits(_req(2, slo_tpot_ms=1.0), pol.begin([]))


def test_late_requests_are_rejected_with_retry_after_and_others_kept():
    clock = Clock()
    pol = _policy(clock, ttft_ms=500.0, tpot_ms=40.0)
    running = _running(pol, 20, out=0)  # past its TPOT cap: new requests wait for slots
    view = pol.begin(running)
    assert pol._batch_cap(view) < 20
    waiting = [_req(i, t=0.0) for i in range(6)]
    clock.t = 0.1
    rejected = pol.expire(running, waiting)
    assert rejected, "requests that wait for a slot 50 tokens away cannot start within 500 ms"
    for r in rejected:
        assert r.retry_after_s >= 1 and math.isfinite(r.retry_after_s) and "TTFT target of 500 ms" in r.message
    # requests without a TTFT target (no default either) are never turned away
    free = _policy(clock, tpot_ms=40.0)
    assert free.expire(running, [_req(51)]) == []


def test_scheduler_with_policy_reports_rejections_and_counts_outcomes():
    clock = Clock()
    pol = _policy(clock, ttft_ms=200.0, tpot_ms=30.0)
    kv = KVCacheManager(1000, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512), kv, admission=pol)
    for i in range(40):
        sched.add_request(_req(i, prompt=64, max_tokens=20, t=0.0))
    rejected, steps = [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        rejected += [r.request_id for r in out.rejected]
        if out.is_empty:
            break
        dt = _true_time(StepFeatures(sum(1 for s in out.scheduled if s.start >= 64), 0,
                                     sum(s.num_tokens for s in out.scheduled if s.start < 64)))
        clock.t += dt
        pol.observe(out.scheduled, dt)
        sched.update_from_output(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
        steps += 1
    st = pol.stats
    assert rejected and st.rejected == len(rejected) and st.requests == 40
    assert 0 < st.met <= 40 - len(rejected)
    assert st.ttft_count == 40 - len(rejected)


def test_ttft_estimate_grows_with_the_queue_and_routing_prefers_the_shorter_prediction():
    from moeserve.engine.dp_balance import LeastLoadedRouter, slo_ranked_ttft
    clock = Clock()
    pol = _policy(clock, ttft_ms=1000.0, tpot_ms=40.0)
    running = _running(pol, 20)
    short, prefill = pol.ttft_estimate(running, [])
    long, _ = pol.ttft_estimate(running, [_req(i) for i in range(10)])
    assert 0 < prefill <= short < long
    router = LeastLoadedRouter(2)
    # rank 0 is less loaded by tokens, but rank 1's admission predicts the shorter TTFT
    router.load = [0, 1000]
    assert router.assign("a", 10, 10, ttft=slo_ranked_ttft([long, short], [prefill] * 2, [0, 0])) == 1
    # requests sent to rank 1 since its report add their prefill: enough of them tip the choice
    many = int((long - short) / prefill) + 1
    assert router.assign("b", 10, 10, ttft=slo_ranked_ttft([long, short], [prefill] * 2, [0, many])) == 0
    assert router.assign("c", 10, 10) == 0  # without targets: least loaded


def test_without_targets_admission_is_plain_fcfs_even_before_calibration():
    pol = SLOAdmission(StepTimeModel(TRUE), Clock(), 512)  # uncalibrated, no default targets
    view = pol.begin([])
    assert all(pol.admits(_req(i), view) for i in range(20))  # no slow start: nobody has a target
    slow = SLOAdmission(StepTimeModel(TRUE), Clock(), 512, default_tpot_ms=1000.0)
    view = slow.begin([])
    assert [slow.admits(_req(i), view) for i in range(3)] == [True, False, False]  # doubles from one


def test_targets_with_tensor_parallelism_are_refused():
    from moeserve.engine_args import EngineArgs
    with pytest.raises(ConfigError, match="--tensor-parallel-size 1"):
        EngineArgs(model="m", tensor_parallel_size=2, slo_ttft_ms=100.0).create_config(4096)
