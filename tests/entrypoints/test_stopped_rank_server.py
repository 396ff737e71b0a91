"""Under `moeserve serve` with DP=2: kill -STOP of a rank ends the streams in flight with an error that names
the stopped rank (not a generic "connection closed"), within --engine-stall-timeout plus the restart, and the
service is back within 15 s of the fault (issue 31)."""
import os
import signal
import threading
import time

import httpx

from tests.entrypoints.server import ServerProcess


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_a_stopped_rank_is_named_to_the_clients_and_the_service_comes_back(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--data-parallel-size", "2",
                      "--enable-expert-parallel", "--engine-stall-timeout", "3", "--engine-restart-backoff", "0.5")
    stopped = None
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        events: list[str] = []

        def stream():
            body = {"model": model, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

        t = threading.Thread(target=stream)
        t.start()
        while len(events) < 3 and t.is_alive():
            time.sleep(0.01)
        ranks = sorted(children(s.engine_pid))
        assert len(ranks) == 2, ranks
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        fault = time.monotonic()
        t.join(60)
        errors = [e for e in events if '"error"' in e]
        assert errors and "is stopped (SIGSTOP or a debugger)" in errors[0], events[-3:]
        assert events[-1] == "[DONE]"
        back = None
        while time.monotonic() - fault < 30:
            if httpx.get(s.url + "/health", timeout=10).status_code == 200:
                back = time.monotonic() - fault
                break
            time.sleep(0.2)
        assert back is not None and back < 15, "".join(s.lines[-30:])
        r = httpx.post(s.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.stop()
