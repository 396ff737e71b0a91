"""`moeserve serve` with two DP ranks: OpenAI completions equal the single-process engine's; a killed rank
turns the server unhealthy (503) instead of hanging."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai

from moeserve import LLM, SamplingParams
from tests.entrypoints.server import ServerProcess

PROMPT = [5, 17, 99, 200, 3, 45, 67]


def test_dp2_server_matches_single_process_and_a_dead_rank_makes_it_unhealthy(ckpt_dir):
    path = ckpt_dir("v3")
    want = LLM(path, dtype="float32").generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    server = ServerProcess(path, "--dtype", "float32", "--data-parallel-size", "2", "--enable-expert-parallel",
                           "--distributed-timeout", "20")
    try:
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        got = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert got.choices[0].text == want[0].outputs[0].text
        # A stop string ends the request by an abort from the front end, after which no rank steps again:
        # the gauges must still come back to idle.
        stop = got.choices[0].text[2:4]
        cut = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=10) == 0
        assert server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=10) == 0
        ranks = subprocess.run(["pgrep", "-P", str(server.engine_pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2, ranks  # the engine-core process started both rank processes
        os.kill(int(ranks[1]), signal.SIGKILL)
        deadline = time.monotonic() + 40
        while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()
