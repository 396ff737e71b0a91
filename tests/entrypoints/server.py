"""A real `moeserve serve` process for tests: started on a free port, stopped and reaped afterwards."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY = re.compile(r"ready on (https?://\S+) .*engine core pid (\d+), API server pids ([\d,]+)")


class ServerProcess:
    def __init__(self, model: str, *args: str, timeout: float = 300.0, stdout_path: str | None = None) -> None:
        """stdout_path: a file for the processes' stdout (uvicorn's access log goes there), else discarded."""
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", model, "--port", "0", *args]
        out = open(stdout_path, "w") if stdout_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        finally:
            if stdout_path:
                out.close()
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.eof = threading.Event()  # stderr closed: the launcher and every process that shares it are gone
        self.url = ""
        self.engine_pid = 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("moeserve serve did not start:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.url, self.engine_pid = m.group(1), int(m.group(2))
                self.api_pids = [int(p) for p in m.group(3).split(",")]
                self._ready.set()
        self._ready.set()  # the process ended
        self.eof.set()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples in /metrics that carry the given labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in want)]
        if not vals:
            raise KeyError(f"{name} not in /metrics")
        return sum(vals)

    def wait_metric(self, name: str, pred, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            v = self.metric(name)
            if pred(v) or time.monotonic() > deadline:
                return v
            time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (a graceful shutdown), SIGKILL if it does not exit in time; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
