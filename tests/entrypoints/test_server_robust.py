"""Issue 19, the server half: request bounds, the port, 405/auth/openapi, a hung engine core and a
graceful SIGTERM; each against a real `moeserve serve` on 127.0.0.1."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from moeserve.cli import main
from tests.entrypoints.server import ServerProcess

BODY_LIMIT = 200_000


@pytest.fixture(scope="module")
def server(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--api-server-count", "2",
                      "--max-request-body-size", str(BODY_LIMIT), "--engine-stall-timeout", "2")
    yield s
    s.stop()


def _complete(server, **body):
    return httpx.post(server.base_url + "/completions", json={"prompt": "hello", "max_tokens": 2, **body},
                      timeout=60)


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    r = httpx.post(server.base_url + "/completions", content=b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert "--max-request-body-size" in err["message"] and err["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"y" * 10_000
        yield b'"}'
    r = httpx.post(server.base_url + "/completions", content=chunked(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert _complete(server).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/completions", {"prompt": "x" * (BODY_LIMIT - 100)}),
    ("/completions", {"prompt": ["hi", "ab" * (BODY_LIMIT // 2 - 100)]}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x" * (BODY_LIMIT - 200)}]}),
])
def test_prompt_text_that_cannot_fit_is_refused_before_tokenizing(server, path, body):
    # ~200 K characters against max-model-len 256: more than 256 tokens can cover, whatever they are
    r = httpx.post(server.base_url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    r = httpx.post(server.url + "/tokenize", json={"prompt": "z" * (BODY_LIMIT - 100)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_just_over_the_context_still_gets_the_exact_token_count(server):
    r = _complete(server, prompt="hello " * 300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens" in r.json()["error"]["message"] and "characters" not in r.json()["error"]["message"]


def test_method_not_allowed_names_the_allowed_methods(server):
    r = httpx.get(server.base_url + "/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "MethodNotAllowedError"
    r = httpx.post(server.url + "/health", timeout=30)
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_openapi_describes_the_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    assert name == "CompletionRequest" and "prompt" in spec["components"]["schemas"][name]["properties"]
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(spec)
    schemas = spec["components"]["schemas"]
    assert refs and all(r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in schemas for r in refs)
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200


def test_a_second_serve_on_the_same_port_is_an_error_naming_port(server, ckpt_dir, capsys):
    port = int(server.url.rsplit(":", 1)[1])
    assert main(["serve", ckpt_dir("v3"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "address already in use" in err and "--port" in err and f"127.0.0.1:{port}" in err
    for _ in range(8):  # every connection is still this deployment's
        assert _complete(server).status_code == 200


def test_a_hung_engine_core_turns_health_503_and_back(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    os.kill(server.engine_pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        while httpx.get(server.url + "/health", timeout=30).status_code == 200:
            assert time.monotonic() - start < 10, "/health stayed 200 for a stopped engine core"
            time.sleep(0.2)
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
    finally:
        os.kill(server.engine_pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _complete(server).status_code == 200


def test_sigterm_lets_streams_in_flight_finish_then_exits_quietly(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "512", "--dtype", "float32", "--shutdown-timeout", "60")
    try:
        body = {"prompt": "x", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(s.url + "/health", timeout=5)
            rest = list(lines)
        events = [line for line in [first, *rest] if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
        assert s.proc.wait(60) == 0
        log = "".join(s.lines)
        assert "Traceback" not in log and "shutting down" in log, log[-3000:]
    finally:
        s.stop()


STREAMS = [  # (path, body): each streams at least a first event, then runs on while the engine core is stopped
    ("/completions", {"prompt": "x", "max_tokens": 480, "stream": True, "ignore_eos": True}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "stream": True,
                           "ignore_eos": True}),
    ("/responses", {"input": "hi", "max_output_tokens": 480, "stream": True, "temperature": 0}),
    ("/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "stream": True,
                   "temperature": 0}),
]


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request whose connection is open (accepted in order, before what is sent after it) when this returns."""
    host, port = url.split("//")[1].rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return sock


def _raw_answer(sock: socket.socket) -> tuple[int, bytes]:
    chunks = []
    while True:
        b = sock.recv(65536)
        if not b:
            break
        chunks.append(b)
    sock.close()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_sigterm_ends_what_outlives_the_grace_period_with_an_error_then_exits_cleanly(ckpt_dir):
    """Issue 31: at the end of --shutdown-timeout every stream still running gets an error event naming the
    shutdown and its end ([DONE]; /v1/responses response.failed, /v1/messages an error event), a request still
    waiting a 503 (code server_shutdown, Retry-After), instead of a connection cut with nothing said; the
    deployment exits 0 with no traceback and no leaked semaphore. The engine core is SIGSTOPped meanwhile, so
    the requests are sure to outlive the grace period whatever the machine's speed."""
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "512", "--dtype", "float32", "--shutdown-timeout", "1",
                      "--api-server-count", "2")
    stopped = False
    try:
        waiting = _raw_post(s.url, "/v1/completions", {"prompt": "x", "max_tokens": 480, "ignore_eos": True})
        got: dict[int, list[str]] = {}
        started = [threading.Event() for _ in STREAMS]

        def read(i, path, body):
            lines = got.setdefault(i, [])
            try:
                with httpx.stream("POST", s.base_url + path, json=body, timeout=120) as r:
                    lines.append(f"status {r.status_code}")
                    for line in r.iter_lines():
                        lines.append(line)
                        started[i].set()
            except httpx.TransportError as e:
                lines.append(f"<cut: {e!r}>")
            started[i].set()
        threads = [threading.Thread(target=read, args=(i, p, b), daemon=True) for i, (p, b) in enumerate(STREAMS)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(120)
        os.kill(s.engine_pid, signal.SIGSTOP)  # nothing finishes from here on
        stopped = True
        s.proc.send_signal(signal.SIGTERM)
        status, body = _raw_answer(waiting)
        assert status == 503, body
        err = json.loads(body)["error"]
        assert err["code"] == "server_shutdown" and "shutting down" in err["message"] and "retry" in err["message"]
        for t in threads:
            t.join(120)
        os.kill(s.engine_pid, signal.SIGCONT)
        stopped = False
        for i, (path, _) in enumerate(STREAMS):
            lines = got[i]
            assert lines[0] == "status 200", lines
            data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            if path in ("/completions", "/chat/completions"):
                assert data[-1] == "[DONE]", lines[-4:]
                err = json.loads(data[-2])["error"]
                assert err["code"] == "server_shutdown" and err["type"] == "ServiceUnavailableError", err
                assert "shutting down" in err["message"] and "retry" in err["message"]
                assert not any('"finish_reason":"length"' in d for d in data), "finished before the SIGSTOP"
            elif path == "/responses":
                last = json.loads(data[-1])
                assert last["type"] == "response.failed", lines[-4:]
                assert last["response"]["error"]["code"] == "server_shutdown"
                assert "shutting down" in last["response"]["error"]["message"]
            else:
                events = [line for line in lines if line.startswith("event: ")]
                assert events[-1] == "event: error", lines[-4:]
                assert "shutting down" in json.loads(data[-1])["error"]["message"]
        assert s.proc.wait(120) == 0
        assert s.eof.wait(60)  # every process that shares the log (the resource tracker too) is gone
        log = "".join(s.lines)
        assert "Traceback" not in log and "leaked semaphore" not in log, log[-3000:]
        assert "Cancel" not in log, log[-3000:]  # nothing was left for uvicorn to cancel
    finally:
        if stopped:
            os.kill(s.engine_pid, signal.SIGCONT)
        s.stop()


def test_a_killed_launcher_leaks_no_semaphore(ckpt_dir):
    """Issue 31: the launcher's ready events (named POSIX semaphores, with the resource tracker) lived as long
    as the deployment, so a launcher that did not exit normally left the tracker to warn of "leaked semaphore
    objects". They are freed once the processes are ready: kill -9 of the launcher leaks nothing."""
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--api-server-count", "2")
    try:
        s.proc.kill()
        s.proc.wait(60)
        assert s.eof.wait(120), "".join(s.lines[-20:])  # the orphans noticed and exited, then the tracker
        log = "".join(s.lines)
        assert "the launcher process died" in log and "leaked semaphore" not in log, log[-3000:]
    finally:
        s.stop()


def test_port_in_use_by_another_program_is_refused_by_the_cli(ckpt_dir):
    import socket
    import sys
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", ckpt_dir("v3"), "--port", str(port)],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "address already in use" in r.stderr and "--port" in r.stderr
    assert "ready on" not in r.stderr


def _wait_health(s, status: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(s.url + "/health", timeout=10).status_code == status:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "".join(s.lines[-30:])
        time.sleep(0.2)


def test_engine_core_deaths_past_max_engine_restarts_stop_the_deployment(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--max-engine-restarts", "1",
                      "--engine-restart-backoff", "0.1")
    try:
        os.kill(s.engine_pid, signal.SIGKILL)
        _wait_health(s, 503)
        _wait_health(s, 200)
        assert _complete(s).status_code == 200
        pid = int(next(line for line in reversed(s.lines) if "the engine core is back" in line)
                  .split("pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)  # the second death within a minute: no restart left
        assert s.proc.wait(60) == 1
        assert any("--max-engine-restarts 1" in line for line in s.lines)
    finally:
        s.stop()


def test_a_big_tokenization_does_not_queue_the_small_ones():
    """Inputs over BIG_INPUT_CHARS tokenize on a thread of their own: a small one is done while it runs."""
    import asyncio

    from moeserve.entrypoints.serving import BIG_INPUT_CHARS, Serving

    release = threading.Event()

    async def go():
        big = asyncio.ensure_future(Serving.off_loop(release.wait, 60, size=BIG_INPUT_CHARS + 1))
        small = await asyncio.wait_for(Serving.off_loop(lambda: "small", size=10), 30)
        assert small == "small" and not big.done()
        release.set()
        assert await big
    asyncio.run(go())
