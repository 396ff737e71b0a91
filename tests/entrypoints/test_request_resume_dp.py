"""Requests survive a restart of a DP=2 + EP engine (issue 31): kill -9 of a rank, then kill -STOP of a rank
(declared after --engine-stall-timeout), each while 8 greedy streams are in flight; every stream finishes
with no error and the output of an unfailed run."""
import os
import signal

import httpx

from tests.entrypoints.server import ServerProcess
from tests.entrypoints.test_request_resume import PROMPTS, _answer, _core_pid, _run_streams
from tests.entrypoints.test_stopped_rank_server import children


def _check(reference: dict, got: dict) -> None:
    for i in range(len(PROMPTS)):
        errors = [e for e in got[i] if isinstance(e, dict) and "error" in e]
        assert not errors and got[i][-1] == "[DONE]", (i, errors, got[i][-3:])
        assert _answer(got[i]) == _answer(reference[i]), i


def test_streams_survive_a_killed_and_a_stopped_rank(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--data-parallel-size", "2",
                      "--enable-expert-parallel", "--engine-stall-timeout", "3", "--engine-restart-backoff", "0.5",
                      "--engine-standby")  # the suite's default is off (tests/conftest.py)
    stopped = None
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run_streams(s.url, model)
        ranks = sorted(children(s.engine_pid))
        assert len(ranks) == 2, ranks
        _check(reference, _run_streams(s.url, model, lambda: os.kill(ranks[1], signal.SIGKILL)))
        assert any("requests in flight resumed" in line for line in s.lines), "".join(s.lines[-20:])
        # the restart came from the standby started after the first start (its ranks started ahead)
        assert any("the standby engine core pid=" in line for line in s.lines), "".join(s.lines[-20:])
        core = _core_pid(s, s.engine_pid)
        ranks = sorted(children(core))
        assert len(ranks) == 2, ranks
        stopped = ranks[0]
        _check(reference, _run_streams(s.url, model, lambda: os.kill(stopped, signal.SIGSTOP)))
        assert any("is stopped (SIGSTOP or a debugger)" in line for line in s.lines), "".join(s.lines[-20:])
        assert s.metric("moeserve:requests_resumed_total") == 2 * len(PROMPTS)
        assert s.metric("moeserve:requests_not_resumed_total") == 0
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.stop()
    # every process that shares the server's stderr is gone: the standby waiting then and its rank processes too
    assert s.eof.wait(60)
