"""SLO-aware admission on a real server: a burst far past what a tight TTFT target allows. Requests the
engine predicts cannot meet their TTFT target get 503 with Retry-After; the admitted ones run, and the
engine's own accounting (/metrics) covers every request. Wall-clock attainment is reported by the engine,
asserted only loosely (a shared machine is noisy)."""
import asyncio

import httpx
import pytest

from tests.entrypoints.server import ServerProcess

TTFT_MS = 1500
BURST = 48


@pytest.fixture(scope="module")
def server(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "4",
                      "--slo-ttft-ms", str(TTFT_MS), "--slo-tpot-ms", "1000")
    yield s
    s.stop()


async def _one(client, url, i, extra=None):
    body = {"prompt": f"request {i} says", "max_tokens": 48, "ignore_eos": True, "stream": True,
            "temperature": 0, **(extra or {})}
    async with client.stream("POST", url, json=body) as r:
        text = (await r.aread()).decode()
        return r.status_code, dict(r.headers), text


def _burst(server, n, extra=None):
    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[_one(c, server.base_url + "/completions", i, extra) for i in range(n)])
    return asyncio.run(run())


def test_burst_past_the_ttft_target_is_partly_turned_away(server):
    # warm up (the first forward is not a sample of the step-time model) and give it steps to calibrate
    for _ in range(2):
        _burst(server, 4)
    before = {k: server.metric(f"moeserve:slo_{k}_total") for k in ("requests", "rejected_requests", "met_requests")}
    results = _burst(server, BURST)
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) + len(refused) == BURST, [r[0] for r in results]
    # 48 requests x 48 tokens through 4 slots take many seconds: most cannot start within 1.5 s
    assert refused and len(ok) >= 4
    for status, headers, text in refused:
        assert int(headers["retry-after"]) >= 1
        assert "TTFT target of 1500 ms" in text and '"code":"overloaded"' in text.replace(" ", "")
    for _, _, text in ok:
        assert text.rstrip().endswith("data: [DONE]")
    server.wait_metric("moeserve:slo_requests_total", lambda v: v - before["requests"] >= BURST)
    after = {k: server.metric(f"moeserve:slo_{k}_total") for k in ("requests", "rejected_requests", "met_requests")}
    assert after["requests"] - before["requests"] == BURST
    assert after["rejected_requests"] - before["rejected_requests"] == len(refused)
    met = after["met_requests"] - before["met_requests"]
    print(f"admitted {len(ok)}, turned away {len(refused)}, met {met:.0f}")
    assert met >= 0.75 * len(ok), f"{met} of {len(ok)} admitted requests met the targets"
    assert server.metric("moeserve:slo_ttft_measured_seconds_total") > 0


def test_a_request_with_its_own_loose_target_is_never_turned_away(server):
    results = _burst(server, 12, {"slo_ttft_ms": 600000})
    assert [r[0] for r in results] == [200] * 12


@pytest.mark.parametrize("value", [0, -1, "1", 1e12, None])
def test_bad_targets_are_400(server, value):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2, "slo_tpot_ms": value},
                   timeout=60)
    if value is None:  # null means "the server's default"
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms", r.text
