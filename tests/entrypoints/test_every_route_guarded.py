"""Issue 32: every route of the API server and of the PD proxy refuses a wrong API key with 401 and every POST
route a body over --max-request-body-size with 413. The routes are enumerated from the apps themselves, so a
new route is checked without anyone listing it here; each check runs against a real server on 127.0.0.1."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from starlette.routing import Route

from moeserve.config import ServerConfig
from moeserve.entrypoints.http_guard import PROBES
from tests.entrypoints.server import ServerProcess

KEY = "sk-guard-test"
LIMIT = 4096
# The only paths answered without the key: probes and docs. Growing this set is a decision, made here.
EXPECTED_PUBLIC = {"/health", "/ping", "/load", "/version", "/metrics", "/docs", "/openapi.json"}


def test_the_public_paths_are_the_probes():
    assert PROBES == EXPECTED_PUBLIC


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app (HEAD: answered as GET)."""
    out = [(m, r.path) for r in app.routes if isinstance(r, Route) for m in sorted(r.methods) if m != "HEAD"]
    assert out
    return out


def api_server_routes(ckpt: str) -> list[tuple[str, str]]:
    """The API server's routes, from the app build_app makes (built, not started: no engine is asked)."""
    from moeserve.entrypoints.api_server import ApiServerSpec, build_app
    from moeserve.entrypoints.engine_client import EngineClient
    from moeserve.tokenizer import load_tokenizer

    spec = ApiServerSpec(index=0, server=ServerConfig(served_model_name="m", api_key=KEY),
                         engine_address="ipc:///nonexistent-moeserve-guard-test", model_path=ckpt,
                         tokenizer_path=ckpt, eos_token_ids=[1], max_model_len=256)
    tokenizer = load_tokenizer(ckpt)
    client = EngineClient(spec.engine_address, tokenizer, [1])
    try:
        return routes(build_app(spec, tokenizer, client, None))
    finally:
        asyncio.run(client.close())


def check_every_route(url: str, table: list[tuple[str, str]], public: set[str]) -> None:
    posts = [path for method, path in table if method == "POST"]
    assert "/v1/chat/completions" in posts
    for method, path in table:
        if path in public:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"x-api-key": "wrong"}):
            r = httpx.request(method, url + path, headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(url + "/nowhere", timeout=30).status_code == 404  # no route: nothing to protect
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'

    def chunked():  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'
    for path in posts:  # probes too: the limit holds for every route
        for content in (big, chunked()):
            r = httpx.post(url + path, content=content, headers=auth, timeout=30)
            assert r.status_code == 413, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and err["type"] == "RequestTooLargeError", err
            assert f"{LIMIT} bytes" in err["message"] and "--max-request-body-size" in err["message"], err


def test_every_api_server_route_needs_the_key_and_every_post_the_body_limit(ckpt_dir):
    ckpt = ckpt_dir("v3")
    table = api_server_routes(ckpt)
    assert {("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/ping")} <= set(table)
    server = ServerProcess(ckpt, "--api-key", KEY, "--max-request-body-size", str(LIMIT), "--max-model-len", "256",
                           "--dtype", "float32")
    try:
        check_every_route(server.url, table, EXPECTED_PUBLIC)
        # a body under the limit with the key reaches the route (a 400 from /v1/messages, not a 401/413);
        # Anthropic clients send x-api-key instead of a Bearer token
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            r = httpx.post(server.url + "/v1/messages", json={"model": "x", "messages": []}, headers=headers,
                           timeout=30)
            assert r.status_code == 400, r.text
        r = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200, r.text
        for path in EXPECTED_PUBLIC - {"/ping"}:  # probes need no key
            assert httpx.get(server.url + path, timeout=30).status_code == 200, path
        assert httpx.post(server.url + "/ping", timeout=30).status_code == 200
        assert server.metric("moeserve:http_errors_total", status="401") > 0  # refusals are counted
        assert server.metric("moeserve:http_errors_total", status="413") > 0
    finally:
        server.stop()


def test_every_proxy_route_needs_the_key_and_every_post_the_body_limit():
    """The PD proxy's app, served on loopback; its instances are not needed (nothing gets that far)."""
    import uvicorn

    from moeserve.entrypoints.pd_proxy import Proxy, build_app

    app = build_app(Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], secret="guard-test-secret", api_key=KEY),
                    max_request_body_size=LIMIT)
    # port 0: the OS picks one as uvicorn binds (a port picked here and bound later could be taken meanwhile)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        table = routes(app)
        assert ("POST", "/v1/completions") in table
        check_every_route(f"http://127.0.0.1:{port}", table, {"/health"})
    finally:
        server.should_exit = True
        thread.join(30)


# The routes that hand work to the engine (or report on it): with the engine gone each answers 503
# engine_dead from the one engine-alive dependency; every other route still answers without it.
ENGINE_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/health", "/ping",
                 "/reset_prefix_cache", "/kv_transfer/release"}


def test_every_engine_route_answers_503_while_the_engine_is_gone(ckpt_dir):
    """The app as build_app makes it, in process (starlette's TestClient, no lifespan: no engine is started),
    with its engine client in the state a dead core leaves it in."""
    from starlette.testclient import TestClient

    from moeserve.entrypoints.api_server import ApiServerSpec, build_app
    from moeserve.entrypoints.engine_client import EngineClient
    from moeserve.tokenizer import load_tokenizer

    ckpt = ckpt_dir("v3")
    spec = ApiServerSpec(index=0, server=ServerConfig(served_model_name="m"),
                         engine_address="ipc:///nonexistent-moeserve-alive-test", model_path=ckpt,
                         tokenizer_path=ckpt, eos_token_ids=[1], max_model_len=256)
    tokenizer = load_tokenizer(ckpt)
    client = EngineClient(spec.engine_address, tokenizer, [1])
    try:
        app = build_app(spec, tokenizer, client, None)
        client.dead_reason = "the engine core exited (test)"
        http = TestClient(app)
        bodies = {"/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
                  "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                  "/v1/responses": {"model": "m", "input": "hi"},
                  "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                  "/tokenize": {"model": "m", "prompt": "hi"}, "/detokenize": {"model": "m", "tokens": [5]},
                  "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
        table = routes(app)
        assert ENGINE_ROUTES <= {path for _, path in table}
        for method, path in table:
            r = http.request(method, path, json=bodies.get(path, {}))
            if path in ENGINE_ROUTES:
                assert r.status_code == 503, (method, path, r.text)
                error = r.json()["error"]  # Anthropic's shape under /v1/messages: no code
                assert error.get("code", "engine_dead") == "engine_dead", (method, path, r.text)
                assert "the engine core exited (test)" in error["message"], (method, path, r.text)
            else:
                assert r.status_code != 503, (method, path, r.text)
    finally:
        asyncio.run(client.close())
