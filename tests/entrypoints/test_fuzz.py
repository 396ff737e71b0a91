"""A bounded fuzz run against a real server: no request drawn from /openapi.json's body schemas (nor junk)
gets a 5xx, and a normal request is served afterwards. The long run: scripts/fuzz_server.py."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.entrypoints.fuzz import CHEAP, body_schemas, bodies, capped, post
from tests.entrypoints.server import ServerProcess

EXAMPLES = 15  # per endpoint: the whole module takes about a minute on the tiny model

@pytest.fixture(scope="module")
def server(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "64", "--dtype", "float32")
    httpx.post(s.base_url + "/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=120)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schemas(server):
    return body_schemas(httpx.get(server.url + "/openapi.json", timeout=30).json())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_fuzzed_requests_get_no_5xx(server, schemas, path):
    bad: list[tuple[int, bytes, str]] = []
    with httpx.Client(timeout=60) as client:
        model = client.get(server.base_url + "/models").json()["data"][0]["id"]
        schema = capped(schemas[path], CHEAP, model)  # sampling fields included: out-of-range values are 400s
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(bodies(schema))
        def run(body):
            r = post(client, server.url + path, body)
            if r.status_code >= 500:
                bad.append((r.status_code, body[:300], r.text[:300]))
        run()
        assert not bad, bad[:5]
        ok = client.post(server.base_url + "/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
