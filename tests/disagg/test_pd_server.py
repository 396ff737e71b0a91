"""PD disaggregation as users run it: a prefill server, a decode server and `moeserve proxy`, as real
processes on 127.0.0.1, driven with the openai client; answers equal a unified server's."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from moeserve.disagg import trust
from tests.entrypoints.server import ROOT, ServerProcess, stop_process

COMMON = ("--max-model-len", "256", "--dtype", "float32")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "a b c d e f g h i j k l m n o p"]
SECRET = "test-deployment-secret-0123456789"  # the instances get it in --kv-transfer-config, the proxy in its env


class ProxyProcess:
    READY = re.compile(r"proxy ready on (http://\S+)")

    def __init__(self, *args: str, env: dict | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               trust.SECRET_ENV: SECRET, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "proxy", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url, self.lines, ready = "", [], threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = self.READY.search(line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60) or not self.url:
            self.stop()
            raise RuntimeError("moeserve proxy did not start:\n" + "".join(self.lines))

    def stop(self) -> None:
        stop_process(self.proc)


def kv(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "nixl", "kv_role": role, "kv_secret": SECRET})


def held(url: str, prompt: str = "hello") -> httpx.Response:
    """A prefill instance's answer, asked for as the proxy does (with its signed ticket)."""
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": trust.ticket(SECRET)})


@pytest.fixture(scope="module")
def pd(ckpt_dir):
    prefill = ServerProcess(ckpt_dir("v3"), *COMMON, *kv("kv_producer"))
    decode = ServerProcess(ckpt_dir("v3"), *COMMON, *kv("kv_consumer"), "--api-server-count", "2")
    proxy = ProxyProcess("--prefill", prefill.url, "--decode", decode.url)
    yield prefill, decode, proxy
    proxy.stop()
    decode.stop()
    prefill.stop()


def complete(url: str, prompt: str, max_tokens: int = 12, **kw) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     **kw).choices[0].text


def test_proxy_answers_equal_a_unified_server(pd, openai_server):
    _, decode, proxy = pd
    for p in PROMPTS:
        assert complete(proxy.url, p) == complete(openai_server.url, p)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "hello there"}]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=None, messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)
    ref = openai.OpenAI(base_url=openai_server.base_url, api_key="none").chat.completions.create(
        model=None, messages=messages, max_tokens=10, temperature=0)
    assert streamed == ref.choices[0].message.content and streamed
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200


def test_structured_output_through_the_proxy_equals_a_unified_server(pd, openai_server):
    # the decode instance samples the first token itself, under the grammar; the prefill one refuses a bad one
    _, _, proxy = pd
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"}},
              "required": ["city", "rain"]}
    for extra in ({"guided_regex": r"\d{3}-[a-z]{2}"}, {"guided_choice": ["yes", "no"], "min_tokens": 4},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}):
        got = complete(proxy.url, "The answer:", extra_body=extra, max_tokens=60)
        assert got == complete(openai_server.url, "The answer:", extra_body=extra, max_tokens=60)
        assert "response_format" not in extra or json.loads(got).keys() == {"city", "rain"}
        assert "guided_regex" not in extra or re.fullmatch(r"\d{3}-[a-z]{2}", got)
    r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "guided_regex": "("}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_proxy_reports_the_prefill_instance_prefix_cache(pd):
    """The second time a long prompt comes, the prefill instance finds most of it cached; the answer the
    client gets from the decode instance says so (JSON and the streamed usage chunk)."""
    _, _, proxy = pd
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none")
    prompt = "import os\nimport sys\n" * 12
    first = client.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text


def test_prefill_answer_carries_kv_params_and_bad_params_are_400(pd, openai_server):
    prefill, decode, proxy = pd
    r = held(prefill.url)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == r.json()["usage"]["prompt_tokens"]
    cases = [
        (prefill.url, {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": "yes"}}, "do_remote_decode"),
        (prefill.url, {"prompt": "hi", "stream": True, "kv_transfer_params": trust.ticket(SECRET)}, "stream"),
        (prefill.url, {"prompt": ["a", "b"], "kv_transfer_params": trust.ticket(SECRET)}, "one prompt"),
        (prefill.url, {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "through the proxy"),
        (decode.url, {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}, "remote_engine_id"),
        (decode.url, {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "decode instance"),
        (decode.url, {"prompt": "hello world", "kv_transfer_params": params}, "another prompt"),
        (openai_server.url, {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "--kv-transfer-config"),
        (proxy.url, {"prompt": "hi", "kv_transfer_params": {}}, "set by the proxy"),
        (proxy.url, "not json", "JSON"),
    ]
    for url, body, words in cases:
        r = httpx.post(url + "/v1/completions", timeout=60,
                       **({"content": body} if isinstance(body, str) else {"json": body}))
        assert r.status_code == 400, (url, body, r.text)
        assert words in r.json()["error"]["message"], r.text


def test_a_forged_kv_location_is_refused_before_any_connection(pd):
    prefill, decode, proxy = pd
    params = held(prefill.url).json()["kv_transfer_params"]
    for change in ({"remote_kv_addrs": [a + (1 << 40) for a in params["remote_kv_addrs"]]},
                   {"remote_host": "10.255.255.1", "remote_port": 9}, {"remote_block_ids": [0, 1, 2]}):
        r = httpx.post(decode.url + "/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "kv_transfer_params": {**params, **change}})
        assert r.status_code == 400 and "signature" in r.json()["error"]["message"], r.text
    # the genuine params still work once, for their prompt; a replay of them is refused
    r = httpx.post(decode.url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    r = httpx.post(decode.url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "kv_transfer_params": params})
    assert r.status_code == 400 and "used already" in r.json()["error"]["message"], r.text
    assert complete(proxy.url, PROMPTS[0])  # the servers still serve


def test_bench_serve_runs_through_the_proxy(pd, tmp_path):
    # the proxy has no /metrics: the benchmark's speculative-decoding scrape used to crash on its 404
    _, _, proxy = pd
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    name = httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    subprocess.run([sys.executable, "-m", "moeserve.cli", "bench", "serve", "--base-url", proxy.url, "--model", name,
                    "--input-len", "32", "--output-len", "8", "--num-prompts", "4", "--ignore-eos", "--no-progress",
                    "--result-json", str(out)], check=True, env=env, stdout=subprocess.DEVNULL, timeout=300)
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 32


def dead_url() -> str:
    """A URL nothing listens at (connection refused)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_instance_is_skipped_and_named(pd, openai_server):
    # A down instance listed first used to be picked for every request (the least loaded: none in flight)
    # and each answered 503, although the other instance was up.
    prefill, decode, _ = pd
    dead_p, dead_d = dead_url(), dead_url()
    proxy = ProxyProcess("--prefill", dead_p, prefill.url, "--decode", dead_d, decode.url)
    try:
        for p in PROMPTS[:2]:
            assert complete(proxy.url, p) == complete(openai_server.url, p)
    finally:
        proxy.stop()
    for args, dead, role in [(("--prefill", dead_p, "--decode", decode.url), dead_p, "prefill"),
                             (("--prefill", prefill.url, "--decode", dead_d), dead_d, "decode")]:
        proxy = ProxyProcess(*args)
        try:
            r = httpx.post(proxy.url + "/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 2})
            err = r.json()["error"]
            assert r.status_code == 503 and dead in err["message"] and role in err["message"], r.text
            assert set(err) == {"message", "type", "param", "code"}
        finally:
            proxy.stop()


def test_what_the_decode_instance_refuses_is_refused_before_the_prefill_holds_kv(pd):
    # The proxy sent the prefill instance max_tokens 1: a request the decode instance then refused (prompt +
    # max_tokens over the context, min_tokens > max_tokens, stream_options without stream) left its prompt's
    # KV held on the prefill instance for kv_hold_timeout (120 s), one prefill's worth per bad request.
    prefill, _, proxy = pd
    time.sleep(0.6)
    before = prefill.metric("vllm:kv_cache_usage_perc")
    for body, param in [({"prompt": "hello", "max_tokens": 300}, "max_tokens"),
                        ({"prompt": "hello", "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
                        ({"prompt": "hello", "stream_options": {"include_usage": True}}, "stream_options"),
                        ({"prompt": "hello", "n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")]:
        r = httpx.post(proxy.url + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert "kv_transfer_params" not in r.json()["error"]["message"], r.text  # the client never sent them
    time.sleep(0.6)  # engine gauges come with its 0.25 s heartbeat
    assert prefill.metric("vllm:kv_cache_usage_perc") <= before


def test_kv_held_for_a_decode_instance_that_refuses_or_is_down_is_released_at_once(ckpt_dir):
    # The prefill instance cannot check what only the decode instance knows (its --max-model-len, its load,
    # whether it is up): when the decode instance then refused the request, or none could be reached, the
    # prompt's KV stayed held on the prefill instance for kv_hold_timeout (120 s), one prompt per request.
    prefill = ServerProcess(ckpt_dir("v3"), *COMMON, *kv("kv_producer"))  # its own: usage 0 when idle
    decode = ServerProcess(ckpt_dir("v3"), "--max-model-len", "64", "--dtype", "float32", *kv("kv_consumer"))
    proxies = [ProxyProcess("--prefill", prefill.url, "--decode", decode.url),
               ProxyProcess("--prefill", prefill.url, "--decode", dead_url())]
    try:
        body = {"prompt": "hello " * 20, "max_tokens": 100}  # fits the prefill's 256 tokens, not the decode's 64
        for proxy, status, code in [(proxies[0], 400, "context_length_exceeded"),
                                    (proxies[1], 503, "upstream_unavailable")]:
            r = httpx.post(proxy.url + "/v1/completions", timeout=60, json=body)
            assert r.status_code == status and r.json()["error"]["code"] == code, r.text
            time.sleep(0.6)  # engine gauges come with its 0.25 s heartbeat: none from before the request
            assert prefill.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=10) == 0
        # The release endpoint itself: what it needs, and only on a prefill instance.
        params = held(prefill.url).json()["kv_transfer_params"]
        unsigned = {k: v for k, v in params.items() if k != "remote_signature"}
        for url, payload, words in [
                (prefill.url, {"kv_transfer_params": {"do_remote_decode": True}}, "prefill instance's answer"),
                (prefill.url, {"kv_transfer_params": {**params, "remote_block_ids": "x"}}, "remote_block_ids"),
                (prefill.url, {"kv_transfer_params": {**params, "remote_request_id": "cmpl-other"}}, "signature"),
                (prefill.url, {"kv_transfer_params": unsigned}, "remote_signature is missing"),
                (prefill.url, params, 'send {"kv_transfer_params"'),
                (prefill.url, "not json", "not valid JSON"),
                (decode.url, {"kv_transfer_params": params}, "holds no KV")]:
            r = httpx.post(url + "/kv_transfer/release", timeout=10,
                           **({"content": payload} if isinstance(payload, str) else {"json": payload}))
            assert r.status_code == 400 and words in r.json()["error"]["message"], (payload, r.text)
        r = httpx.post(prefill.url + "/kv_transfer/release", timeout=10, json={"kv_transfer_params": params})
        assert r.status_code == 200 and r.json() == {"released": params["remote_request_id"]}, r.text
        assert prefill.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=10) == 0
    finally:
        for p in (*proxies, decode, prefill):
            p.stop()


def test_a_client_leaving_a_json_request_aborts_it_at_the_decode_instance(pd):
    # Nothing watched the client of a non-streaming request: the decode instance generated all of it for nobody.
    import socket
    _, decode, proxy = pd
    aborted = decode.metric("vllm:request_success_total", finished_reason="abort")
    body = json.dumps({"prompt": "hi", "max_tokens": 240, "ignore_eos": True})
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert decode.wait_metric("vllm:num_requests_running", lambda v: v >= 1) >= 1
    sock.close()
    deadline = time.monotonic() + 15
    while decode.metric("vllm:request_success_total", finished_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert decode.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0) == 0


class FakeInstance:
    """A one-shot HTTP server on 127.0.0.1 answering each connection with `reply` (raw bytes), then closing."""

    def __init__(self, reply: bytes) -> None:
        import socket
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                length = re.search(rb"(?i)content-length: (\d+)", head)  # none: the proxy's GET /health
                n = int(length.group(1)) if length else 0
                while len(rest) < n:
                    rest += conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error_event():
    # The proxy used to cut the client's connection (a broken chunked read) with no word of what happened.
    params = {"do_remote_prefill": True, "remote_engine_id": "x"}
    answer = json.dumps({"usage": {"prompt_tokens": 2}, "kv_transfer_params": params}).encode()
    prefill = FakeInstance(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                           + str(len(answer)).encode() + b"\r\n\r\n" + answer)
    event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    decode = FakeInstance(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                          + f"{len(event):x}\r\n".encode() + event + b"\r\n")  # then the connection closes
    proxy = ProxyProcess("--prefill", prefill.url, "--decode", decode.url)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "stream": True}) as r:
            body = b"".join(r.iter_raw()).decode()
        events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        assert events[0] == event.decode()[6:].strip() and events[-1] == "[DONE]", body
        err = json.loads(events[-2])["error"]
        assert err["code"] == "upstream_unavailable" and decode.url in err["message"], body
    finally:
        proxy.stop()
        prefill.close()
        decode.close()


def test_sixteen_concurrent_requests_through_the_proxy_equal_a_unified_server(pd, openai_server):
    import asyncio
    prefill, decode, proxy = pd

    async def one(client, url, i):
        body = {"prompt": f"request {i} " * (1 + i % 5), "max_tokens": 8 + i, "temperature": 0,
                "stream": i % 2 == 0}
        if not body["stream"]:
            r = await client.post(url + "/v1/completions", json=body)
            return r.json()["choices"][0]["text"]
        text = ""
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            got = await asyncio.gather(*(one(client, proxy.url, i) for i in range(16)))
            want = [await one(client, openai_server.url, i) for i in range(16)]
            return got, want

    got, want = asyncio.run(main())
    assert got == want
    assert decode.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0) == 0


def test_prefill_choice_weighs_the_prompt_prefix_an_instance_has_computed():
    from moeserve.entrypoints.pd_proxy import PREFIX_CHUNK_CHARS, Upstream, by_preference, prefix_hashes
    history = "x" * (3 * PREFIX_CHUNK_CHARS + 10)
    a, b = Upstream("http://a"), Upstream("http://b")
    a.remember(prefix_hashes(history))
    turn2 = prefix_hashes(history + "next question")
    a.load = 2 * PREFIX_CHUNK_CHARS  # busier, but holds 3 chunks of the prompt
    assert by_preference([b, a], turn2)[0] is a
    a.load = 4 * PREFIX_CHUNK_CHARS  # busier than its cached part is worth
    assert by_preference([b, a], turn2)[0] is b
    assert by_preference([a, b], prefix_hashes("y" * 1000))[0] is b  # nothing shared: least loaded
    assert prefix_hashes("z" * (PREFIX_CHUNK_CHARS - 1)) == []


def test_prefix_memory_evicts_tails_first_and_skips_error_answers(monkeypatch):
    import asyncio

    from moeserve.entrypoints import pd_proxy as P
    monkeypatch.setattr(P, "MAX_PREFIX_CHUNKS", 4)
    up, long = P.Upstream("http://a"), P.prefix_hashes("x" * (10 * P.PREFIX_CHUNK_CHARS))
    up.remember(long)  # 10 chunks into room for 4: the head must stay (a headless chain never matches)
    assert up.matched_chars(long) == 4 * P.PREFIX_CHUNK_CHARS

    # A prefill instance that refused the request (400) computed nothing: it must not be remembered.
    def handler(request):
        return httpx.Response(400, json={"error": {"message": "bad", "param": "max_tokens"}})
    proxy = P.Proxy(["http://pre"], ["http://dec"], secret=SECRET)
    proxy.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    body = json.dumps({"prompt": "y" * 600, "max_tokens": -1}).encode()
    answer = asyncio.run(proxy._handle("/v1/completions", body))
    assert answer.status_code == 400 and not proxy.prefill[0].prefixes
