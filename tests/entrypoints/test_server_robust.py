"""Issue 19, the server half: request bounds, the port, 405/auth/openapi, a hung engine core and a
graceful SIGTERM; each against a real `moeserve serve` on 127.0.0.1."""
from __future__ import annotations

import os
import signal
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


def test_sigterm_drain_is_bounded_by_shutdown_timeout(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "512", "--dtype", "float32", "--shutdown-timeout", "0")
    try:
        body = {"prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True}
        got: list[str] = []

        def read():
            try:
                with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as r:
                    got.extend(r.iter_lines())
            except httpx.TransportError:
                got.append("<cut>")
        t = threading.Thread(target=read, daemon=True)
        t.start()
        while not got:
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0  # --shutdown-timeout 0: the stream is cut at once, not finished
        t.join(30)
        assert "data: [DONE]" not in got
        assert "Traceback" not in "".join(s.lines), "".join(s.lines)[-3000:]
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
