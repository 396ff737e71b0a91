"""The PD proxy and SLO-aware admission: a prefill instance that turns a request away (503 + Retry-After,
its admission predicts a missed TTFT target) passes it to the next; the last refusal reaches the client."""
import asyncio
import json

import httpx

from moeserve.entrypoints import pd_proxy as P


def _run(proxy, body):
    return asyncio.run(proxy._handle("/v1/completions", json.dumps(body).encode()))


def _proxy(replies):
    tried = []

    def handler(request):
        tried.append(str(request.url.host))
        return replies[request.url.host]()
    proxy = P.Proxy(["http://a", "http://b"], ["http://dec"], secret="slo-test-deployment-secret")
    proxy.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return proxy, tried


def _turned_away():
    return httpx.Response(503, headers={"Retry-After": "7"},
                          json={"error": {"message": "the server cannot meet this request's TTFT target",
                                          "code": "overloaded"}})


def test_every_prefill_instance_turning_the_request_away_gives_503_with_retry_after():
    proxy, tried = _proxy({"a": _turned_away, "b": _turned_away})
    answer = _run(proxy, {"prompt": "hello", "max_tokens": 4, "slo_ttft_ms": 100})
    assert sorted(tried) == ["a", "b"]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
    assert b"TTFT target" in answer.body


def test_the_next_prefill_instance_serves_what_the_first_turned_away():
    def prefill_ok():
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {"prompt_tokens": 2},
                                         "kv_transfer_params": {"remote_block_ids": [1]}})
    proxy, tried = _proxy({"a": _turned_away, "b": prefill_ok,
                           "dec": lambda: httpx.Response(200, json={"choices": [{"text": "done"}]})})
    answer = _run(proxy, {"prompt": "hello", "max_tokens": 4, "slo_ttft_ms": 100})
    assert tried[:2] == ["a", "b"] and tried[-1] == "dec"
    assert answer.status_code == 200 and b"done" in answer.body


def test_a_plain_503_is_relayed_without_trying_another_instance():
    proxy, tried = _proxy({"a": lambda: httpx.Response(503, json={"error": {"message": "engine dead"}}),
                           "b": _turned_away})
    answer = _run(proxy, {"prompt": "hello", "max_tokens": 4})
    assert tried == ["a"] and answer.status_code == 503 and "retry-after" not in answer.headers
