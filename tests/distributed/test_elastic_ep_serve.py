"""`moeserve serve --enable-elastic-ep` with DP=3 + EP (issue 37): a rank killed while 8 greedy streams are in
flight. The engine core is not restarted, /health stays 200 throughout, every stream finishes with the output
of an unfailed run, and /metrics says the engine is degraded, counts the loss and the re-queued requests."""
import os
import signal
import threading
import time

import httpx

from moeserve.engine.elastic import TEST_HANG_ENV
from tests.entrypoints.server import ServerProcess
from tests.entrypoints.test_request_resume import PROMPTS, _answer, _run_streams
from tests.entrypoints.test_stopped_rank_server import children


def elastic_server(ckpt_dir, *extra: str) -> ServerProcess:
    """`moeserve serve` of the tiny V3 checkpoint, DP=3 + EP, elastic (8 experts + 1 replica over 3 ranks)."""
    return ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--data-parallel-size",
                         "3", "--enable-expert-parallel", "--num-redundant-experts", "1", "--enable-elastic-ep", *extra)


def test_streams_ride_through_a_killed_rank_and_health_stays_200(ckpt_dir):
    s = elastic_server(ckpt_dir)
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run_streams(s.url, model)
        assert s.metric("moeserve:elastic_ep_degraded") == 0
        core = s.engine_pid
        ranks = sorted(children(core))
        assert len(ranks) == 3, ranks
        health: list[int] = []
        done = threading.Event()

        def poll_health():
            while not done.is_set():
                health.append(httpx.get(s.url + "/health", timeout=30).status_code)
                done.wait(0.1)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        try:
            got = _run_streams(s.url, model, lambda: os.kill(ranks[1], signal.SIGKILL))
        finally:
            done.set()
            poller.join(35)
        for i in range(len(PROMPTS)):
            errors = [e for e in got[i] if isinstance(e, dict) and "error" in e]
            assert not errors and got[i][-1] == "[DONE]", (i, errors, got[i][-3:])
            assert _answer(got[i]) == _answer(reference[i]), i
        assert len(health) > 5 and set(health) == {200}, health
        assert not any("the engine core is back" in line for line in s.lines)  # no restart: a ride-through
        assert sorted(children(core)) == [ranks[0], ranks[2]]
        assert s.metric("moeserve:elastic_ep_degraded") == 1
        assert s.metric("moeserve:elastic_ep_rank_losses_total") == 1
        assert s.metric("moeserve:elastic_ep_recovery_seconds_count") == 1
        # the killed rank's streams are re-queued, the survivors keep theirs (8 streams over 3 ranks)
        assert 0 < s.metric("moeserve:elastic_ep_requests_requeued_total") < len(PROMPTS)
        assert s.metric("moeserve:elastic_ep_tokens_recomputed_total") > 0
        assert s.metric("moeserve:requests_resumed_total") == 0  # the API server saw no engine death
    finally:
        s.stop()


def joiner(pid: int) -> bool:
    """A replacement or spare rank process (dp_worker --join)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"--join" in f.read().split(b"\0")


def test_replacement_rank_joins_and_the_degraded_gauge_returns_to_0(ckpt_dir):
    # --elastic-ep-replace: once the two survivors serve, the engine core starts a third rank process; it
    # joins the next epoch (the server's stats heartbeat drives the idle front end), and the outputs stay
    s = elastic_server(ckpt_dir, "--elastic-ep-replace")
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run_streams(s.url, model)
        core = s.engine_pid
        ranks = sorted(p for p in children(core) if not joiner(p))  # the fourth is the spare (dp_worker --join)
        assert len(ranks) == 3 and len(children(core)) == 4
        got = _run_streams(s.url, model, lambda: os.kill(ranks[1], signal.SIGKILL))
        for i in range(len(PROMPTS)):
            assert got[i][-1] == "[DONE]" and _answer(got[i]) == _answer(reference[i]), i
        deadline = time.monotonic() + 180
        while s.metric("moeserve:elastic_ep_degraded") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert s.metric("moeserve:elastic_ep_degraded") == 0
        assert s.metric("moeserve:elastic_ep_rank_losses_total") == 1
        now = sorted(children(core))  # the two survivors, the replacement and the next spare (started ahead)
        assert len(now) == 4 and ranks[1] not in now and {ranks[0], ranks[2]} < set(now), (ranks, now)
        assert sum(map(joiner, now)) == 2
        again = _run_streams(s.url, model)  # the three serve
        for i in range(len(PROMPTS)):
            assert _answer(again[i]) == _answer(reference[i]), i
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    finally:
        s.stop()


def test_streams_ride_through_a_hung_rank(ckpt_dir, monkeypatch):
    # rank 1 busy-loops at its 250th step: the first batch of streams (the reference) takes ~170 lockstep steps,
    # so it hangs mid-way through the second; the engine core kills it after --elastic-ep-hang-timeout and the
    # two others finish every stream with the reference's output
    monkeypatch.setenv(TEST_HANG_ENV, "1:250:spin")
    s = elastic_server(ckpt_dir, "--elastic-ep-hang-timeout", "3")
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run_streams(s.url, model)
        assert s.metric("moeserve:elastic_ep_rank_losses_total") == 0, "the rank hung during the reference run"
        ranks = sorted(children(s.engine_pid))
        got = _run_streams(s.url, model)
        for i in range(len(PROMPTS)):
            errors = [e for e in got[i] if isinstance(e, dict) and "error" in e]
            assert not errors and got[i][-1] == "[DONE]", (i, errors, got[i][-3:])
            assert _answer(got[i]) == _answer(reference[i]), i
        assert s.metric("moeserve:elastic_ep_rank_losses_total") == 1
        assert any("began no collective" in line and "killing it" in line for line in s.lines)
        assert sorted(children(s.engine_pid)) == [ranks[0], ranks[2]]
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    finally:
        s.stop()
