"""A PD deployment (prefill + decode + proxy, real processes) on a checkpoint whose token NAN_TOKEN gives NaN
logits: the issue's request is a 400 through the proxy, a request whose prefill logits are not finite fails
alone, and the prefill instance serves the next requests (it used to die on either)."""
import httpx
import pytest

from tests.checkpoints import NAN_TOKEN, write_nan_token_checkpoint
from tests.disagg.test_pd_server import COMMON, ProxyProcess, kv
from tests.entrypoints.server import ServerProcess

GOOD = [[5, 17, 99], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    path = write_nan_token_checkpoint(str(tmp_path_factory.mktemp("nan") / "v3-nan"))
    unified = ServerProcess(path, *COMMON)
    prefill = ServerProcess(path, *COMMON, *kv("kv_producer"))
    decode = ServerProcess(path, *COMMON, *kv("kv_consumer"))
    proxy = ProxyProcess("--prefill", prefill.url, "--decode", decode.url)
    yield unified, prefill, proxy
    proxy.stop()
    decode.stop()
    prefill.stop()
    unified.stop()


def complete(url, prompt):
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def test_pd_prefill_survives_bad_requests(pd):
    unified, prefill, proxy = pd
    want = [complete(unified.url, p).json()["choices"][0]["text"] for p in GOOD]
    r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 1, "temperature": 1, "repetition_penalty": 1e-300})
    assert r.status_code == 400 and "repetition_penalty" in r.text, r.text
    r = complete(proxy.url, [5, 6, NAN_TOKEN, 8])
    assert r.status_code >= 400 and "not finite" in r.text, r.text
    assert [complete(proxy.url, p).json()["choices"][0]["text"] for p in GOOD] == want
    assert httpx.get(prefill.url + "/health").status_code == 200
