"""Requests survive an engine restart (issue 31): a request re-submitted with the tokens it generated so far
(EngineCoreRequest.output_token_ids) continues exactly where it stopped, on a fresh engine core."""
import json
import os
import signal
import threading
import time

import httpx
import pytest

from moeserve.engine.engine_core import EngineCore
from moeserve.engine_args import EngineArgs
from moeserve.protocol import EngineCoreRequest
from moeserve.sampling_params import SamplingParams
from tests.entrypoints.server import ServerProcess

PROMPT = [5, 17, 42, 7, 99, 3]


def _generate(core: EngineCore, req: EngineCoreRequest) -> list[int]:
    core.add_request(req)
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=1234),  # the seed's generator is put where the first engine's was
    dict(temperature=0.8, seed=7, top_k=20, frequency_penalty=0.5, presence_penalty=0.3),
], ids=["greedy", "seeded", "seeded-penalties"])
def test_a_resumed_request_continues_exactly(ckpt_dir, params):
    args = EngineArgs(model=ckpt_dir("v3"), dtype="float32")
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **params)
    whole = _generate(EngineCore(args.create_config(256)), EngineCoreRequest("a", PROMPT, sp))
    assert len(whole) == 24
    for cut in (1, 9):  # the restarted engine is a new EngineCore: no state of the first one survives
        rest = _generate(EngineCore(args.create_config(256)),
                         EngineCoreRequest("a", PROMPT, sp, output_token_ids=whole[:cut]))
        assert whole[:cut] + rest == whole, cut


# ---- a real server whose engine core is killed while streams are in flight -------------------------------
PROMPTS = ["hello", "The capital of France", "1 2 3 4", "Once upon a time", "def f(x):", "zebra", "A B C",
           "moeserve"]


def _stream(url: str, model: str, i: int, out: dict) -> None:
    """One greedy completion stream: its events (JSON or [DONE]) in out[i]."""
    body = {"model": model, "prompt": PROMPTS[i], "max_tokens": 160, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    if i % 2:
        body["logprobs"] = 1  # tokens and text offsets must continue across the restart too
    events = out[i] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))


def _answer(events: list) -> dict:
    """What a client puts together from a stream: text, finish reason, usage, logprob tokens and offsets."""
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    return {"text": "".join(c["choices"][0]["text"] for c in chunks),
            "finish": chunks[-1]["choices"][0]["finish_reason"],
            "usage": next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage")),
            "tokens": [t for lp in lps for t in lp["tokens"]],
            "offsets": [o for lp in lps for o in lp["text_offset"]]}


def _run_streams(url: str, model: str, fault=None) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, model, i, out)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    if fault is not None:
        while not all(len(out.get(i, ())) >= 3 for i in range(len(PROMPTS))):  # every stream is running
            assert all(t.is_alive() for t in threads), "a stream ended before the fault"
            time.sleep(0.01)
        fault()
    for t in threads:
        t.join(180)
    return out


def test_streams_survive_a_killed_engine_core(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32",
                      "--engine-restart-backoff", "0.5")
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reference = _run_streams(s.url, model)
        killed = _run_streams(s.url, model, lambda: os.kill(s.engine_pid, signal.SIGKILL))
        for i in range(len(PROMPTS)):
            errors = [e for e in killed[i] if isinstance(e, dict) and "error" in e]
            assert not errors and killed[i][-1] == "[DONE]", (i, errors, killed[i][-3:])
            want, got = _answer(reference[i]), _answer(killed[i])
            assert got == want, i
            assert got["usage"]["completion_tokens"] == 160 and got["finish"] == "length"
        assert any("requests in flight resumed" in line for line in s.lines), "".join(s.lines[-20:])
        assert s.metric("moeserve:requests_resumed_total") == len(PROMPTS)
        assert s.metric("moeserve:request_resume_latency_seconds_count") == len(PROMPTS)
        assert s.metric("moeserve:requests_not_resumed_total") == 0
    finally:
        s.stop()
    # the killed core left nothing to the resource tracker (its checkpoint loader's tqdm lock is a thread lock)
    assert s.eof.wait(60)
    assert not any("leaked semaphore" in line for line in s.lines), "".join(s.lines[-5:])


def _core_pid(s: ServerProcess, after: int) -> int:
    """The pid of the engine core the launcher started last, once it is not `after`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        back = [line for line in s.lines if "the engine core is back" in line]
        if back:
            pid = int(back[-1].split("pid ")[1].split(")")[0])
            if pid != after:
                return pid
        time.sleep(0.05)
    raise AssertionError("".join(s.lines[-20:]))


def test_requests_in_flight_during_two_deaths_in_a_row_are_resumed_one_at_a_time(ckpt_dir):
    """Two kill -9s nobody's request caused: the request in flight through both is a suspect, resumed alone,
    and (the engine not dying again) finishes as an unfailed run, as does the one started in between."""
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32",
                      "--engine-restart-backoff", "0.5")
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        want: dict = {}
        _stream(s.url, model, 0, want)
        _stream(s.url, model, 1, want)
        out: dict = {}
        a = threading.Thread(target=_stream, args=(s.url, model, 0, out))
        a.start()
        while len(out.get(0, ())) < 3:
            time.sleep(0.01)
        os.kill(s.engine_pid, signal.SIGKILL)  # death 1: stream 0 is resumed
        second = _core_pid(s, s.engine_pid)
        while not s.metric("moeserve:requests_resumed_total"):
            time.sleep(0.05)
        b = threading.Thread(target=_stream, args=(s.url, model, 1, out))  # on the second core only
        b.start()
        while len(out.get(1, ())) < 3:
            time.sleep(0.01)
        os.kill(second, signal.SIGKILL)  # death 2 in a row for stream 0, not alone: a suspect, not failed
        a.join(120)
        b.join(120)
        for i in (0, 1):
            assert not any(isinstance(e, dict) and "error" in e for e in out[i]) and out[i][-1] == "[DONE]", i
            assert _answer(out[i]) == _answer(want[i]), i
        assert sum("alone among suspects" in line for line in s.lines) == 1, "".join(s.lines[-20:])
        assert s.metric("moeserve:requests_not_resumed_total") == 0
        assert s.metric("moeserve:requests_resumed_total") == 3  # stream 0 twice, stream 1 once
    finally:
        s.stop()


CRASH_TOKEN = 7  # MOESERVE_TEST_CRASH_TOKEN: an engine core that steps a prompt holding it kills itself


def test_the_request_that_kills_the_engine_every_time_is_failed_alone(ckpt_dir, monkeypatch):
    """A poisoned request (its every step SIGKILLs the engine core) arrives while innocent streams are in flight:
    the first two deaths take them all, the suspects are then resumed one at a time, and only the poisoned one
    dies alone and is failed; the innocent streams finish with the output of an unfailed run."""
    monkeypatch.setenv("MOESERVE_TEST_CRASH_TOKEN", str(CRASH_TOKEN))
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32",
                      "--engine-restart-backoff", "0.5")  # 3 deaths: within --max-engine-restarts 3
    innocent = (0, 1, 2)
    try:
        model = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i in innocent:
            ids = httpx.post(s.url + "/tokenize", json={"model": model, "prompt": PROMPTS[i]}, timeout=10).json()
            assert CRASH_TOKEN not in ids["tokens"], ids
        want: dict = {}
        for i in innocent:
            _stream(s.url, model, i, want)
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(s.url, model, i, out)) for i in innocent]
        for t in threads:
            t.start()
        while not all(len(out.get(i, ())) >= 3 for i in innocent):
            time.sleep(0.01)
        poisoned: list = []

        def poison() -> None:  # it never has a token, so its error is the HTTP answer itself
            body = {"model": model, "prompt": [5, CRASH_TOKEN, 9], "max_tokens": 16, "temperature": 0}
            poisoned.append(httpx.post(s.url + "/v1/completions", json=body, timeout=180))
        p = threading.Thread(target=poison)
        p.start()
        p.join(180)
        for t in threads:
            t.join(180)
        assert poisoned[0].status_code == 503, poisoned[0].text
        error = poisoned[0].json()["error"]
        assert "MOESERVE_MAX_REQUEST_CRASHES=2" in error["message"], error
        assert "3 engine-core deaths in a row" in error["message"] and error["code"] == "engine_dead", error
        for i in innocent:
            assert not any(isinstance(e, dict) and "error" in e for e in out[i]) and out[i][-1] == "[DONE]", i
            assert _answer(out[i]) == _answer(want[i]), i
        assert sum("kills itself" in line for line in s.lines) == 3, "".join(s.lines[-30:])
        assert sum("alone among suspects" in line for line in s.lines) == 4, "".join(s.lines[-30:])
        assert s.metric("moeserve:requests_not_resumed_total", reason="crash_limit") == 1
    finally:
        s.stop()
