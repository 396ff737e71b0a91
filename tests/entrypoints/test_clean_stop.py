"""Issue 31, the shutdown race and the stall race, with the real pieces: an engine core (EngineCoreProc over a
real engine, a real ROUTER socket), the API server's EngineClient over ipc://, and `moeserve serve` with two
API servers.

- A clean stop logged "client ... unreachable; dropping it" (WARNING): the launcher stops the API servers
  first and the core heartbeats until its own SIGTERM, so a heartbeat could hit a client that had just closed.
  Now a client says goodbye before it closes, and the core reports a lost client only if no goodbye came.
- With --api-server-count 2, a hung core turned /health 503 on each API server when that server's event loop
  had read the last heartbeat: a server that read late stayed 200 after the other turned 503. Now heartbeats
  carry the core's monotonic time and every server measures the silence from it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import httpx
import pytest
import zmq

from moeserve import LLM
from moeserve.entrypoints.engine_client import EngineClient
from moeserve.engine.engine_core_proc import HEARTBEAT_S, EngineCoreProc
from moeserve.protocol import MSG_HELLO, EngineCoreHello
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer
from tests.entrypoints.server import ServerProcess


@pytest.fixture
def core(ckpt_dir, tmp_path):
    """A real engine core serving on ipc:// from a thread of this process (its loop is EngineCoreProc.run)."""
    path = ckpt_dir("v3")
    llm = LLM(path, dtype="float32", max_model_len=256)
    proc = EngineCoreProc(llm.engine, f"ipc://{tmp_path}/core", log_stats=False)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    yield proc, path
    proc.running = False
    thread.join(10)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moeserve.engine_core" and r.levelno >= logging.WARNING]


def test_a_client_that_stops_cleanly_leaves_no_warning(core, caplog):
    proc, path = core
    caplog.set_level(logging.DEBUG, logger="moeserve.engine_core")

    async def serve_and_close():
        client = EngineClient(proc.sock.getsockopt_string(zmq.LAST_ENDPOINT), load_tokenizer(path), [1])
        await client.start()
        deltas = [d async for d in client.generate("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert deltas[-1].finished
        await client.close()
    for _ in range(3):  # each time, heartbeats go on for a while after the client closed
        asyncio.run(serve_and_close())
        time.sleep(4 * HEARTBEAT_S)
        assert not proc.clients and not proc.owner
    assert not _warnings(caplog), _warnings(caplog)
    assert any("said goodbye" in r.getMessage() for r in caplog.records)


def test_a_client_that_vanishes_is_still_reported(core, caplog):
    """No goodbye (a crashed or killed API server): the core says it dropped the client and its requests."""
    import msgspec
    proc, _ = core
    caplog.set_level(logging.DEBUG, logger="moeserve.engine_core")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"api-vanishing")
    sock.connect(proc.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    sock.send_multipart([MSG_HELLO, msgspec.msgpack.encode(EngineCoreHello(0))])
    assert sock.poll(10_000) and sock.recv_multipart()[0] == MSG_HELLO
    sock.close(0)
    ctx.term()
    deadline = time.monotonic() + 5
    while not _warnings(caplog) and time.monotonic() < deadline:
        time.sleep(0.05)
    lost = _warnings(caplog)
    assert len(lost) == 1 and "api-vanishing" in lost[0] and "without saying goodbye" in lost[0], lost
    assert not proc.clients


def _pinned(url: str, count: int) -> dict[int, httpx.Client]:
    """One kept-alive connection to each API server (the kernel hands each new connection to one of them)."""
    pinned: dict[int, httpx.Client] = {}
    for _ in range(200):
        c = httpx.Client(base_url=url, timeout=30)
        index = c.get("/server_info").json()["api_server_index"]
        if index in pinned:
            c.close()
        else:
            pinned[index] = c
        if len(pinned) == count:
            return pinned
    raise AssertionError(f"reached only API servers {sorted(pinned)} of {count}")


def test_api_servers_agree_on_a_hung_engine_core(ckpt_dir):
    """API server 1 reads the last heartbeats 1.5 s late (it was stopped while the core stopped): it stayed
    /health 200 that much longer than API server 0. They now turn 503 at the same moment."""
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--api-server-count", "2",
                      "--engine-stall-timeout", "2")
    pinned = {}
    try:
        pinned = _pinned(s.url, 2)
        assert all(c.get("/health").status_code == 200 for c in pinned.values())
        late = s.api_pids[1]
        os.kill(late, signal.SIGSTOP)
        try:
            time.sleep(0.3)  # server 1 has not read these heartbeats yet
            os.kill(s.engine_pid, signal.SIGSTOP)
            time.sleep(1.5)
        finally:
            os.kill(late, signal.SIGCONT)
        try:
            turned: dict[int, float] = {}
            deadline = time.monotonic() + 15
            while len(turned) < 2 and time.monotonic() < deadline:
                for i, c in pinned.items():
                    if i not in turned:
                        r = c.get("/health")
                        if r.status_code == 503:
                            assert r.json()["error"]["code"] == "engine_stalled", r.text
                            turned[i] = time.monotonic()
                time.sleep(0.02)
            assert len(turned) == 2, turned
            # both measure the core's silence from its own last heartbeat: one moment, not 1.5 s apart
            assert abs(turned[0] - turned[1]) < 0.5, turned
            for c in pinned.values():  # and stay 503 while it is stopped
                assert c.get("/health").status_code == 503
        finally:
            os.kill(s.engine_pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not all(c.get("/health").status_code == 200 for c in pinned.values()):
            assert time.monotonic() < deadline, "/health did not come back after SIGCONT"
            time.sleep(0.1)
        for c in pinned.values():
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        for c in pinned.values():
            c.close()
        s.stop()
    noisy = [line for line in s.lines if " WARNING " in line or "Traceback" in line]
    assert not noisy, noisy
