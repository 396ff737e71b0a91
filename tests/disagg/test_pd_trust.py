"""The PD trust boundary and failure handling with real processes: listeners bind the configured host, only
this deployment's signed kv_transfer_params are honoured, the proxy has its own key and routes around dead
engines, pulls from a dead prefill fail together (docs/disaggregation.md, "Trust")."""
import asyncio
import os
import signal
import socket
import time

import httpx
import pytest

from moeserve import LLM
from moeserve.disagg import metadata, trust
from moeserve.protocol import EngineCoreRequest
from tests.disagg.test_pd_engine import NIXL, PROMPTS, SECRET, greedy, hold, resign, run
from tests.disagg.test_pd_server import COMMON, ProxyProcess, held, kv
from tests.entrypoints.server import ServerProcess
from tests.listeners import external_address, listening, wide

EXTERNAL = external_address()


def rank_pids(engine) -> list[int]:
    return [p.pid for p in engine.ranks.procs.values()]


@pytest.mark.parametrize("host", ["127.0.0.1", EXTERNAL])
def test_every_listener_binds_the_configured_host(ckpt_dir, host):
    """DP2 + EP with a NIXL agent per rank: TCPStore (rank 0), gloo, ZMQ (front end), the KV metadata server
    and UCX used to listen on every interface (0.0.0.0 / ::) or the external one, whatever the flags said."""
    if host is None:
        pytest.skip("this machine has no non-loopback address")
    before = listening(os.getpid())
    llm = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8, data_parallel_size=2,
              enable_expert_parallel=True, master_addr=host, kv_transfer_config={**NIXL, "kv_host": host})
    try:
        allowed = {host, "127.0.0.1"} if host != "127.0.0.1" else {"127.0.0.1"}
        found = {pid: listening(pid) for pid in rank_pids(llm.engine)}
        found[os.getpid()] = listening(os.getpid()) - before  # the front end: its ZMQ socket
        for pid, socks in found.items():
            assert socks and {h for h, _ in socks} <= allowed, (pid, socks)
        ranks = [listening(pid) for pid in rank_pids(llm.engine)]
        # each rank's KV metadata server is on the host it advertises
        assert all(any(h == host for h, _ in socks) for socks in ranks), ranks
        assert any(h == host for h, _ in found[os.getpid()]), found[os.getpid()]
        got = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=greedy(4))
        assert all(len(o.outputs[0].token_ids) == 4 for o in got)
    finally:
        llm.engine.shutdown()


def test_a_single_engine_listens_on_loopback_only(ckpt_dir):
    before = listening(os.getpid())
    eng = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8, kv_transfer_config=NIXL).engine
    new = listening(os.getpid()) - before
    assert (eng.kv_transfer.host, eng.kv_transfer.port) in new and not wide(new), new


def test_an_agent_without_the_secret_gets_no_metadata(ckpt_dir):
    """A foreign NIXL agent that knew the engine's name and port fetched its metadata (NIXL's listener
    answers anyone) and read raw KV blocks. Now neither NIXL's protocol nor ours without the secret gets it."""
    from moeserve.disagg.nixl_connector import _nixl_api
    eng = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8, kv_transfer_config=NIXL).engine
    host, port, name = eng.kv_transfer.host, eng.kv_transfer.port, eng.kv_transfer.engine_id
    api = _nixl_api()
    foreign = api.nixl_agent("foreign", api.nixl_agent_config(enable_listen_thread=True, listen_port=0,
                                                              backends=["UCX"]))
    foreign.fetch_remote_metadata(name, host, port)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert not foreign.check_remote_metadata(name)
        time.sleep(0.1)
    with pytest.raises(ConnectionError):
        metadata.fetch(host, port, "another-deployment-secret-000")
    meta, _ = metadata.fetch(host, port, SECRET)  # the deployment's own secret: served
    assert meta == eng.kv_transfer.connector.agent.get_agent_metadata()


def test_untrusted_params_are_refused_before_any_connection(engines_pd):
    """A client of a decode instance's endpoint made it connect to any host:port (and stall on it), and read
    blocks by id. Params must be signed by this deployment, for this prompt, once; anything else is refused
    when the request arrives, before a connection or a queued pull."""
    prefill, decode = engines_pd
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(1.0)
    prefill.add_request(EngineCoreRequest("t0", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    _, done = run(prefill)
    good = done["t0"].kv_transfer_params
    cases = {"f1": ({**good, "remote_host": "127.0.0.1", "remote_port": trap.getsockname()[1]}, "signature"),
             "f2": ({**good, "remote_block_ids": [b + 1 for b in good["remote_block_ids"]]}, "signature"),
             "f3": ({k: v for k, v in good.items() if k != "remote_signature"}, "remote_signature is missing"),
             "f4": (trust.sign_params("another-deployment-secret-000", good, PROMPTS[0], 60), "signature"),
             "f5": ({**resign(good, PROMPTS[0]), "remote_expires": time.time() - 1}, "signature"),
             "f6": (trust.sign_params(SECRET, {k: v for k, v in good.items() if k != "remote_signature"},
                                      PROMPTS[0], -1), "expired")}
    for rid, (params, _) in cases.items():
        decode.add_request(EngineCoreRequest(rid, PROMPTS[0], greedy(2), [], kv_transfer_params=params))
    assert not decode.kv_transfer.pulls  # none of them waits for anything
    _, done = run(decode)
    for rid, (_, words) in cases.items():
        assert words in done[rid].error, (rid, done[rid].error)
    with pytest.raises(socket.timeout):
        trap.accept()  # nobody connected to the host:port a client named
    trap.close()
    # the genuine params serve once; a replay (the blocks may hold another request's KV by then) is refused
    decode.add_request(EngineCoreRequest("g1", PROMPTS[0], greedy(2), [], kv_transfer_params=good))
    decode.add_request(EngineCoreRequest("g2", PROMPTS[0], greedy(2), [], kv_transfer_params=good))
    tokens, done = run(decode)
    assert len(tokens["g1"]) == 2 and "used already" in done["g2"].error


def test_only_the_proxy_can_make_a_prefill_hold_kv(engines_pd):
    """{"do_remote_decode": true} from anyone held a prompt's KV for kv_hold_timeout (a pool filler)."""
    prefill, _ = engines_pd
    ticket = hold()
    for rid, params, words in [("h1", {"do_remote_decode": True}, "through the proxy"),
                               ("h2", {**hold(), "proxy_signature": "00" * 32}, "did not sign"),
                               ("h3", trust.ticket(SECRET, ttl=-1), "expired"),
                               ("h4", ticket, None), ("h5", ticket, "used already")]:
        prefill.add_request(EngineCoreRequest(rid, PROMPTS[1], greedy(1), [], kv_transfer_params=params))
        _, done = run(prefill)
        if words is None:
            assert done[rid].error is None and done[rid].kv_transfer_params["remote_signature"]
        else:
            assert words in done[rid].error, (rid, done[rid].error)
    assert prefill.kv_transfer.num_held == 1


@pytest.fixture(scope="module")
def engines_pd(ckpt_dir):
    kw = dict(dtype="float32", max_model_len=256, block_size=8)
    return (LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_producer"}, **kw).engine,
            LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_consumer"}, **kw).engine)


def test_pulls_waiting_on_a_killed_prefill_fail_together(ckpt_dir):
    """Requests waiting to pull from a dead prefill failed one after another, each after its own 10 s
    metadata timeout. Now nothing listening at the prefill's address fails them all at once."""
    prefill = ServerProcess(ckpt_dir("v3"), *COMMON, *kv("kv_producer"))
    decode = ServerProcess(ckpt_dir("v3"), *COMMON, *kv("kv_consumer"))
    try:
        params = held(prefill.url, "warm up").json()["kv_transfer_params"]  # the decode loads its metadata
        r = httpx.post(decode.url + "/v1/completions", timeout=60,
                       json={"prompt": "warm up", "max_tokens": 2, "kv_transfer_params": params})
        assert r.status_code == 200, r.text
        prompts = [f"prompt number {i}" for i in range(3)]
        waiting = [held(prefill.url, p).json()["kv_transfer_params"] for p in prompts]
        for pid in (prefill.engine_pid, *prefill.api_pids, prefill.proc.pid):
            os.kill(pid, signal.SIGKILL)

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(decode.url + "/v1/completions", json={
                    "prompt": p, "max_tokens": 2, "kv_transfer_params": k}) for p, k in zip(prompts, waiting)))
        for r in asyncio.run(main()):
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "kv_transfer", r.text
            assert "the prefill process is gone" in err["message"], r.text  # not "did not answer within 10 s"
        assert decode.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0) == 0
    finally:
        decode.stop()
        prefill.stop()


def test_the_proxy_refuses_to_start_without_the_secret():
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != trust.SECRET_ENV}
    r = subprocess.run([sys.executable, "-m", "moeserve.cli", "proxy", "--prefill", "http://127.0.0.1:1",
                        "--decode", "http://127.0.0.1:2"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and trust.SECRET_ENV in r.stderr, r.stderr


KEY_PROXY, KEY_INSTANCES = "proxy-client-key", "deployment-instance-key"


@pytest.fixture(scope="module")
def keyed(ckpt_dir):
    """Two prefill instances, one decode instance, all with the deployment's --api-key; the proxy with its own."""
    keyarg = ("--api-key", KEY_INSTANCES)
    servers = [ServerProcess(ckpt_dir("v3"), *COMMON, *kv(role), *keyarg)
               for role in ("kv_producer", "kv_producer", "kv_consumer")]
    proxy = ProxyProcess("--prefill", servers[0].url, servers[1].url, "--decode", servers[2].url,
                         "--api-key", KEY_PROXY, env={"MOESERVE_API_KEY": KEY_INSTANCES})
    yield servers, proxy
    proxy.stop()
    for s in servers:
        s.stop()


def post(url, body, key=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60, **kw)


def test_the_proxy_has_its_own_key_and_never_forwards_the_clients(keyed):
    """The proxy forwarded the client's Authorization: any proxy client held the key that opens the instances."""
    (pre, _, dec), proxy = keyed
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    assert post(proxy.url, body, KEY_PROXY).status_code == 200
    for key in (None, KEY_INSTANCES, "wrong"):
        r = post(proxy.url, body, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_PROXY}"}).status_code == 200
    assert httpx.get(proxy.url + "/v1/models").status_code == 401
    for inst in (pre, dec):  # the proxy's client key opens no instance
        assert post(inst.url, body, KEY_PROXY).status_code == 401


def test_the_proxy_answers_bad_json_and_methods_with_openai_errors(keyed):
    _, proxy = keyed
    auth = {"Authorization": f"Bearer {KEY_PROXY}", "Content-Type": "application/json"}
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "max_tokens": Infinity}',
                b'{"prompt": "x", "n": -Infinity}', b'{"a": ' * 100000 + b'1' + b'}' * 100000, b'\xff\xfe',
                b'{"a": ' * 1000 + b'1' + b'}' * 1000, b'{"prompt": "x", "max_tokens": 1' + b'0' * 5000 + b'}'):
        r = httpx.post(proxy.url + "/v1/completions", content=raw, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (raw[:40], r.text)
    # An overflowing float literal is inf once parsed: it was a plain-text 500 (inf cannot be re-encoded).
    for field in ("temperature", "max_tokens", "top_p"):
        for lit in (b"1e999", b"-1e400"):
            raw = b'{"prompt": "x", "%s": %s}' % (field.encode(), lit)
            r = httpx.post(proxy.url + "/v1/completions", content=raw, headers=auth, timeout=30)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (raw, r.text)
            err = r.json()["error"]
            assert err["param"] == field and "finite number" in err["message"], err
    r = httpx.post(proxy.url + "/v1/chat/completions", headers=auth, timeout=30,
                   content=b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.get(proxy.url + "/v1/completions", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"], r.text
    r = httpx.get(proxy.url + "/nowhere")
    assert r.status_code == 404 and "error" in r.json(), r.text
    assert post(proxy.url, {"prompt": "still serving", "max_tokens": 2}, KEY_PROXY).status_code == 200


def test_every_instance_route_parses_json_bounded(keyed):
    """A prefill instance's /kv_transfer/release answered 500 RecursionError to JSON nested 1,000 deep (the
    stdlib parser); every JSON body of an instance now goes through the bounded parser: a 400 naming why."""
    (pre, _, dec), _ = keyed
    auth = {"Authorization": f"Bearer {KEY_INSTANCES}", "Content-Type": "application/json"}
    deep = b'[' * 1000 + b']' * 1000
    cases = [(pre, "/kv_transfer/release", b'{"kv_transfer_params": ' + deep + b'}', "nested too deeply"),
             (pre, "/kv_transfer/release", b'{"kv_transfer_params": {"remote_block_ids": [1e999]}}', "finite number"),
             (pre, "/kv_transfer/release", b'{"kv_transfer_params": NaN}', "finite number")]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize"):
        cases.append((dec, path, b'{"prompt": ' + deep + b'}', "JSON"))
    for path, body in (("/v1/responses", b'{"input": "x", "temperature": 1e999}'),
                       ("/v1/messages", b'{"messages": [], "max_tokens": 1e999}'),
                       ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}'),
                       ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e999}')):
        cases.append((dec, path, body, ""))
    for inst, path, raw, words in cases:
        r = httpx.post(inst.url + path, content=raw, headers=auth, timeout=30)
        assert r.status_code == 400, (path, raw[:60], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert words in err["message"], (path, err)
        if b"1e999" in raw and "/kv_transfer" not in path:
            if path == "/v1/messages":  # Anthropic's error shape: no param, the message names the field
                assert r.json()["type"] == "error" and "max_tokens" in err["message"], (path, err)
            else:
                assert err["param"] in ("temperature", "max_tokens"), (path, err)
    assert httpx.get(pre.url + "/health").status_code == 200 and httpx.get(dec.url + "/health").status_code == 200


def served(inst) -> float:
    """Requests an instance's engine finished (its API server's counter: it outlives an engine restart)."""
    return inst.metric("vllm:request_success_total")


def wait_health(url: str, status: int, timeout: float = 120.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/health", timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_the_proxy_routes_around_a_prefill_whose_engine_is_dead(keyed):
    """HTTP still answered, the engine behind it did not: 10 of 20 requests failed with 1 of 2 prefills dead.
    The dead one is the first listed, which every request goes to while both are idle and healthy. Its
    launcher is held (SIGSTOP) so that it cannot restart the engine while the proxy is checked (the restart
    after --engine-restart-backoff made the instance healthy again mid-test); released, it restarts the
    engine and the proxy routes to the instance again."""
    (pre_a, pre_b, _), proxy = keyed
    os.kill(pre_a.proc.pid, signal.SIGSTOP)  # the launcher: its API server answers, nobody restarts the engine
    try:
        os.kill(pre_a.engine_pid, signal.SIGKILL)
        r = wait_health(pre_a.url, 503, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text  # HTTP answers
        r = httpx.get(proxy.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["prefill"] == {pre_a.url: False, pre_b.url: True}, r.text
        before_a, before_b = served(pre_a), served(pre_b)
        for i in range(20):
            r = post(proxy.url, {"prompt": f"request {i} " * (1 + i % 3), "max_tokens": 3}, KEY_PROXY)
            assert r.status_code == 200, (i, r.text)
        assert served(pre_b) - before_b == 20 and served(pre_a) == before_a  # all routed to the live prefill
        r = httpx.get(proxy.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["prefill"] == {pre_a.url: False, pre_b.url: True}, r.text
    finally:
        os.kill(pre_a.proc.pid, signal.SIGCONT)  # the launcher restarts the engine (the fixture's other users)
    assert wait_health(pre_a.url, 200).status_code == 200, "".join(pre_a.lines[-20:])
    r = wait_health(proxy.url, 200, timeout=10)
    assert r.status_code == 200 and r.json()["prefill"] == {pre_a.url: True, pre_b.url: True}, r.text
    before_a = served(pre_a)
    r = post(proxy.url, {"prompt": "back again", "max_tokens": 3}, KEY_PROXY)
    assert r.status_code == 200 and served(pre_a) == before_a + 1, r.text  # routed to it again


def test_pulls_waiting_on_a_hung_prefill_fail_together(engines_pd, monkeypatch):
    """A prefill that accepts connections but never answers (hung): pulls that arrived at different times
    all fail when the first one's metadata wait runs out, in one step (they failed 10 s apart, one by one)."""
    from moeserve.engine import kv_transfer
    monkeypatch.setattr(kv_transfer, "METADATA_TIMEOUT_S", 1.0)
    monkeypatch.setattr(metadata, "IO_TIMEOUT_S", 0.3)
    prefill, decode = engines_pd
    hung = socket.create_server(("127.0.0.1", 0))  # the kernel completes handshakes; nobody ever answers
    prompts = [PROMPTS[0], PROMPTS[2], list(range(100, 130))]
    params = []
    for i, p in enumerate(prompts):
        prefill.add_request(EngineCoreRequest(f"hung-p{i}", p, greedy(1), [], kv_transfer_params=hold()))
        _, done = run(prefill)
        params.append(resign(done[f"hung-p{i}"].kv_transfer_params, p, remote_engine_id="hung",
                             remote_port=hung.getsockname()[1]))  # an insider's params: a real location
    decode.add_request(EngineCoreRequest("hung-d0", prompts[0], greedy(2), [], kv_transfer_params=params[0]))
    failed_at: dict[str, int] = {}
    step = 0
    t0 = time.monotonic()
    while decode.has_unfinished():
        step += 1
        if step == 1:
            time.sleep(0.5)  # the others come later
        elif step == 2:
            for i in (1, 2):
                decode.add_request(EngineCoreRequest(f"hung-d{i}", prompts[i], greedy(2), [],
                                                     kv_transfer_params=params[i]))
        for out in decode.step():
            if out.error:
                failed_at[out.request_id] = step
        assert time.monotonic() - t0 < 30
    hung.close()
    assert set(failed_at) == {"hung-d0", "hung-d1", "hung-d2"} and len(set(failed_at.values())) == 1, failed_at
    assert decode.kv.pool.num_free == decode.kv.pool.num_blocks
