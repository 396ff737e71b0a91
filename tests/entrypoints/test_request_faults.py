"""A real `moeserve serve` on a checkpoint whose token NAN_TOKEN gives NaN logits: a request the math would
break is a 400 naming the field, a request whose logits are not finite anyway is that request's error (an
OpenAI error body, or an SSE error event), and the requests beside and after it are served unchanged. The
same for a DP=2 engine."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from moeserve import LLM, SamplingParams
from tests.checkpoints import NAN_TOKEN, write_nan_token_checkpoint
from tests.entrypoints.server import ServerProcess

GOOD = [[5, 17, 99], [20, 21, 22, 23], list(range(30, 70))]
POISONED = [5, 6, NAN_TOKEN] + list(range(100, 137))
ISSUE = {"prompt": "x", "max_tokens": 1, "temperature": 1, "repetition_penalty": 1e-300}


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    llm = LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompt_token_ids=GOOD, sampling_params=params)]


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory):
    return write_nan_token_checkpoint(str(tmp_path_factory.mktemp("nan") / "v3-nan"))


def post(server, path, body, **kw):
    return httpx.post(server.base_url + path, json=body, timeout=120, **kw)


def complete(server, prompt):
    r = post(server, "/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def check_faults(server, reference):
    # The issue's request: the math would break, so it is refused before any work, naming the field.
    for path, body in (("/completions", ISSUE),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                              "repetition_penalty": 1e-300})):  # chat: temperature 1 by default
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    # Non-finite logits from the model itself: that request's error, while two others run beside it.
    texts: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: texts.__setitem__(i, complete(server, GOOD[i]))) for i in (0, 2)]
    for t in threads:
        t.start()
    r = post(server, "/completions", {"prompt": POISONED, "max_tokens": 8, "temperature": 0})
    for t in threads:
        t.join(120)
    assert r.status_code == 500 and "not finite" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "InternalServerError"
    assert texts == {0: reference[0], 2: reference[2]}
    with httpx.stream("POST", server.base_url + "/completions", timeout=120,
                      json={"prompt": POISONED, "max_tokens": 8, "stream": True}) as s:
        s.read()
    assert s.status_code == 500 and "not finite" in s.json()["error"]["message"]  # before any event: a status
    # Mid-stream (16-token steps: the short prompt streams while the long one, not cached, still prefills):
    # an error event.
    late = [9, 8, NAN_TOKEN] + list(range(200, 237))
    with httpx.stream("POST", server.base_url + "/completions", timeout=120,
                      json={"prompt": [GOOD[0], late], "max_tokens": 8, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.status_code == 200 and events[0]["choices"][0]["text"] is not None, events
    assert "not finite" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == "internal_error"
    # Afterwards (the NaN request's KV blocks are free for reuse) every request is served as before.
    assert [complete(server, p) for p in GOOD] == reference
    assert httpx.get(server.url + "/health").status_code == 200


def test_server_answers_bad_requests_alone_and_keeps_serving(nan_path, reference):
    server = ServerProcess(nan_path, "--max-model-len", "256", "--dtype", "float32", "--max-num-batched-tokens", "16")
    try:
        check_faults(server, reference)
    finally:
        server.stop()


def test_dp2_server_answers_bad_requests_alone_and_keeps_serving(nan_path, reference):
    server = ServerProcess(nan_path, "--max-model-len", "256", "--dtype", "float32", "--max-num-batched-tokens", "16",
                           "--data-parallel-size", "2",
                           "--enable-expert-parallel", "--distributed-timeout", "20")
    try:
        check_faults(server, reference)
    finally:
        server.stop()


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_BODIES = [
    ({"guided_regex": "(" * 250 + "a" + ")" * 250}, "guided_regex", "nested more than"),
    ({"structured_outputs": {"regex": "(?:" * 60 + "a" + ")" * 60}}, "structured_outputs", "nested more than"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(70)}}},
     "response_format", "nested more than"),
    ({"logit_bias": {"１２": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {"1_000": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {" 12": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {"+12": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {"012": 1}}, "logit_bias", "plain decimal"),
    ({"stop_token_ids": [10 ** 6]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [10 ** 6], "stream": True}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"repetition_penalty": 0.001}, "repetition_penalty", "must be in"),
    ({"repetition_penalty": 1e300}, "repetition_penalty", "must be in"),
]


@pytest.mark.parametrize("extra,param,words", BAD_BODIES)
def test_bad_values_are_a_400_naming_the_field(openai_server, extra, param, words):
    r = post(openai_server, "/completions", {"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_nan_and_infinity_are_a_400_and_the_server_serves_afterwards(openai_server):
    for field in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"):
        for value in ("NaN", "Infinity", "-Infinity"):
            body = '{"prompt": "x", "max_tokens": 2, "%s": %s}' % (field, value)
            r = httpx.post(openai_server.base_url + "/completions", content=body, timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    r = post(openai_server, "/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"12": 5}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = post(openai_server, "/completions", {"prompt": "x", "max_tokens": 4, "allowed_token_ids": [50],
                                             "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert len(set(r.json()["choices"][0]["logprobs"]["tokens"])) == 1  # one token, four times


def test_big_enums_compile_outside_the_engine_while_a_stream_runs(openai_server):
    """The engine-core process refuses to compile (structured/params.py): big enums that are answered prove
    their automata were compiled in the API server and sent, while another stream kept going."""
    enum = {"type": "object", "properties": {"k": {"enum": [f"v{j}-0" for j in range(1500)]}}, "required": ["k"]}
    results: dict[int, httpx.Response] = {}

    def guided(i):
        schema = json.loads(json.dumps(enum).replace("-0", f"-{i}"))
        results[i] = post(openai_server, "/completions", {"prompt": "x", "max_tokens": 30, "temperature": 0,
                                                         "response_format": {"type": "json_schema", "json_schema":
                                                                             {"name": "e", "schema": schema}}})
    with httpx.stream("POST", openai_server.base_url + "/completions", timeout=120,
                      json={"prompt": "y", "max_tokens": 60, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        next(lines)
        threads = [threading.Thread(target=guided, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        streamed = sum(1 for line in lines if line.startswith("data: {"))
    for t in threads:
        t.join(120)
    assert streamed >= 59
    for r in results.values():
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["text"])["k"].startswith("v")
