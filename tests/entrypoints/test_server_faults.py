"""API key, the bounded waiting queue and a killed engine core, on one server (the last test kills it, and
the launcher brings it back)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.server import ServerProcess

KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def server(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--api-key", KEY, "--max-waiting-requests", "1", "--max-num-seqs", "1",
                      "--max-model-len", "512", "--dtype", "float32", "--engine-restart-backoff", "5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(server):
    r = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return r.json()["data"][0]["id"]


def test_api_key(server, model):
    c = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model=model, prompt="x", max_tokens=2)
    r = httpx.post(server.base_url + "/completions", json={"model": model, "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert ok.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def _long_stream(server, model):
    body = {"model": model, "prompt": "x", "max_tokens": 480, "stream": True, "ignore_eos": True}
    return httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120,
                        headers={"Authorization": f"Bearer {KEY}"})


def test_full_waiting_queue_answers_503(server, model):
    # One request running (max-num-seqs 1), one waiting (max-waiting-requests 1): the next one is refused.
    with _long_stream(server, model) as running:
        lines = running.iter_lines()
        next(lines)
        waiting = threading.Thread(target=lambda: _drain(server, model), daemon=True)
        waiting.start()
        assert server.wait_metric("vllm:num_requests_waiting", lambda v: v == 1) == 1
        c = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=model, prompt="y", max_tokens=2)
        assert e.value.status_code == 503 and "--max-waiting-requests" in e.value.message
        # vLLM's vllm:admission_rejections, with moeserve's bound as the reason
        assert server.wait_metric("vllm:admission_rejections_total", lambda v: v == 1) == 1
        assert server.metric("vllm:admission_rejections_total", reason="max_waiting_requests") == 1
    waiting.join(120)  # the hung-up stream frees the slot, the waiting request runs to the end
    assert not waiting.is_alive()
    assert c.completions.create(model=model, prompt="y", max_tokens=2).usage.completion_tokens >= 1


def test_a_fan_out_larger_than_the_waiting_queue_is_a_400_not_a_503_forever(server, model):
    # max-waiting-requests 1: n=2 could never be admitted, so retrying (what a 503 asks for) cannot help.
    for body in ({"prompt": "x", "n": 2}, {"prompt": ["x", "y"]}, {"prompt": "x", "n": 2, "stream": True}):
        r = httpx.post(server.base_url + "/completions", json={"model": model, "max_tokens": 2, **body},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400 and "--max-waiting-requests" in r.json()["error"]["message"], r.text


def _drain(server, model):
    body = {"model": model, "prompt": "z", "max_tokens": 4}
    httpx.post(server.base_url + "/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {KEY}"})


def test_engine_core_killed_gives_503_and_unhealthy_until_it_is_restarted(server, model):
    c = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    with _long_stream(server, model) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(server.engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(server.url + "/health").status_code == 503
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=model, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and time.monotonic() - start < 10
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503
        # the stream in flight waits for the new core and is resumed there (issue 31): it ends normally
        rest = list(lines)
    rest = [line for line in rest if line]
    assert not any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
    # --engine-restart-backoff 5: the launcher starts a new core, the API servers reconnect, service resumes
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "".join(server.lines[-30:])
        time.sleep(0.2)
    assert c.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert any("restarting it in 5.0 s" in line for line in server.lines)
