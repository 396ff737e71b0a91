"""`moeserve serve --logprobs-mode processed_logprobs` over HTTP: logprobs are those of the distribution the
token was drawn from (here top_k 2: two tokens share all the probability), and the tokens top-k masks (-inf)
come as -9999.0, as vLLM answers them (JSON has no infinity). The values against the model's own logits are
checked offline (tests/engine/test_logprobs_mode.py)."""
from __future__ import annotations

import math

import httpx
import pytest

from tests.entrypoints.server import ServerProcess

MASKED = -9999.0


@pytest.fixture(scope="module")
def server(ckpt_dir):
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--enforce-eager",
                      "--served-model-name", "m", "--logprobs-mode", "processed_logprobs")
    yield s
    s.stop()


def _check_top(values: list[float]) -> None:
    """Two tokens carry the whole top-k 2 distribution; the third asked for is masked."""
    finite = [v for v in values if v != MASKED]
    assert len(finite) == 2 and len(values) - len(finite) >= 1
    assert math.fsum(math.exp(v) for v in finite) == pytest.approx(1.0, abs=1e-4)


def test_completions_report_the_processed_distribution(server):
    r = httpx.post(server.base_url + "/completions", json={
        "model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 1,
        "logprobs": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 4
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        _check_top(list(top.values()))
        assert chosen != MASKED and chosen in top.values()  # the drawn token is one of the two


def test_chat_reports_the_processed_distribution(server):
    r = httpx.post(server.base_url + "/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.0,
        "top_k": 2, "seed": 1, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        _check_top([t["logprob"] for t in entry["top_logprobs"]])
        assert entry["logprob"] > MASKED
