"""vLLM's ops flags doing what vLLM does (issue 33), against real servers: one started with every flag, one
without (the control): --enable-force-include-usage, --enable-request-id-headers, --disable-fastapi-docs,
--max-log-len, --return-tokens-as-token-ids, --response-role, --disable-uvicorn-access-log,
--no-enable-prompt-tokens-details."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.entrypoints.server import ServerProcess

COMMON = ("--max-model-len", "256", "--dtype", "float32", "--enforce-eager", "--uvicorn-log-level", "info")


@pytest.fixture(scope="module")
def ops(ckpt_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ops") / "stdout.log")
    server = ServerProcess(ckpt_dir("v3"), *COMMON, "--served-model-name", "m", "--enable-force-include-usage",
                           "--enable-request-id-headers", "--disable-fastapi-docs", "--enable-log-requests",
                           "--max-log-len", "7", "--return-tokens-as-token-ids", "--response-role", "model",
                           "--disable-uvicorn-access-log", "--no-enable-prompt-tokens-details", stdout_path=out)
    server.stdout_path = out
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(ckpt_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("plain") / "stdout.log")
    server = ServerProcess(ckpt_dir("v3"), *COMMON, "--served-model-name", "m", "--enable-log-requests",
                           stdout_path=out)
    server.stdout_path = out
    yield server
    server.stop()


def _stream(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.base_url + path, json={"model": "m", "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("path,body", [("/completions", {"prompt": "hello", "max_tokens": 3}),
                                       ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 3})])
def test_force_include_usage(ops, plain, path, body):
    """Without stream_options a stream ends with a usage chunk (vLLM's --enable-force-include-usage)."""
    events = _stream(ops, path, body)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert _stream(plain, path, body)[-1].get("usage") is None


def test_request_id_headers(ops, plain):
    r = httpx.post(ops.base_url + "/completions", json={"model": "m", "prompt": "a", "max_tokens": 1},
                   headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    fresh = httpx.get(ops.url + "/health", timeout=30).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh)
    # an error answered before any route (404) carries it too
    assert httpx.get(ops.url + "/no/such/route", timeout=30).headers["x-request-id"]
    assert "x-request-id" not in httpx.get(plain.url + "/health", timeout=30).headers


def test_fastapi_docs_disabled(ops, plain):
    assert httpx.get(ops.url + "/docs", timeout=30).status_code == 404
    assert httpx.get(ops.url + "/openapi.json", timeout=30).status_code == 404
    assert httpx.get(plain.url + "/openapi.json", timeout=30).status_code == 200
    assert httpx.get(plain.url + "/docs", timeout=30).status_code == 200


def _wait_line(server, pattern: str, start: int = 0, timeout: float = 15.0) -> str:
    """The first log line (stderr) from index `start` on matching pattern."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = next((line for line in list(server.lines)[start:] if re.search(pattern, line)), None)
        if hit:
            return hit
        time.sleep(0.1)
    raise AssertionError(f"no log line matches {pattern!r}:\n" + "".join(server.lines[-20:]))


def test_max_log_len_logs_the_cut_prompt(ops, plain):
    prompt = "The quick brown fox jumps over the lazy dog"
    mark, mark_plain = len(ops.lines), len(plain.lines)
    r = httpx.post(ops.base_url + "/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                                        "return_token_ids": True}, timeout=60)
    ids = r.json()["choices"][0]["prompt_token_ids"]
    line = _wait_line(ops, r"Received request .*prompt: ", mark)
    assert f"prompt: {prompt[:7]!r}" in line, line
    assert f"prompt_token_ids: {ids[:7]}" in line, line
    httpx.post(plain.base_url + "/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}, timeout=60)
    line = _wait_line(plain, r"Received request ", mark_plain)
    assert "quick" not in line and "prompt tokens: " in line  # moeserve's default: no prompt text


def test_tokens_as_token_ids(ops):
    r = httpx.post(ops.base_url + "/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2,
                                                        "logprobs": 2, "return_token_ids": True}, timeout=60).json()
    lp, ids = r["choices"][0]["logprobs"], r["choices"][0]["token_ids"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    assert all(all(re.fullmatch(r"token_id:\d+", k) for k in top) for top in lp["top_logprobs"])
    chat = httpx.post(ops.base_url + "/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 1, "return_token_ids": True}, timeout=60).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in chat["token_ids"]]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    # the request's own return_tokens_as_token_ids: false wins
    r = httpx.post(ops.base_url + "/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2,
                                                        "logprobs": 1, "return_tokens_as_token_ids": False},
                   timeout=60).json()
    assert not any(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])


def test_request_return_tokens_as_token_ids(plain):
    r = httpx.post(plain.base_url + "/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2,
                                                          "logprobs": 1, "return_tokens_as_token_ids": True},
                   timeout=60).json()
    assert all(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])


def test_response_role(ops, plain):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(ops.base_url + "/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 2},
                   timeout=60).json()
    assert r["choices"][0]["message"]["role"] == "model"
    events = _stream(ops, "/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert events[0]["choices"][0]["delta"]["role"] == "model"
    # continuing the last message: its own role (vLLM's)
    cont = httpx.post(ops.base_url + "/chat/completions", json={
        "model": "m", "messages": msgs + [{"role": "assistant", "content": "Hel"}], "max_tokens": 2,
        "add_generation_prompt": False, "continue_final_message": True}, timeout=60).json()
    assert cont["choices"][0]["message"]["role"] == "assistant"
    r = httpx.post(plain.base_url + "/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 2},
                   timeout=60).json()
    assert r["choices"][0]["message"]["role"] == "assistant"


def test_access_log_disabled(ops, plain):
    """uvicorn writes its access log to stdout: a line per request at --uvicorn-log-level info, none with
    --disable-uvicorn-access-log."""
    for server in (ops, plain):
        httpx.post(server.base_url + "/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=60)
    access = '"POST /v1/completions HTTP/1.1" 200'
    deadline = time.monotonic() + 15
    while access not in open(plain.stdout_path).read() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert access in open(plain.stdout_path).read()
    assert "HTTP/1.1" not in open(ops.stdout_path).read()


def test_prompt_tokens_details(ops, plain):
    body = {"model": "m", "prompt": "hello there", "max_tokens": 1}
    assert httpx.post(ops.base_url + "/completions", json=body, timeout=60).json()["usage"].get(
        "prompt_tokens_details") is None
    details = httpx.post(plain.base_url + "/completions", json=body, timeout=60).json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= 0
