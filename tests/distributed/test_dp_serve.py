"""`moeserve serve` with two DP ranks: OpenAI completions equal the single-process engine's; a killed rank
turns the server unhealthy (503) instead of hanging, a hung (SIGSTOPped) rank within seconds, and either
way the launcher restarts the engine core (and its ranks) and the server serves again."""
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


def _ranks(server) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(server.engine_pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _wait_health(server, status: int, timeout: float) -> float:
    start = time.monotonic()
    while httpx.get(server.url + "/health", timeout=10).status_code != status:
        assert time.monotonic() - start < timeout, "".join(server.lines[-30:])
        time.sleep(0.2)
    return time.monotonic() - start


def _new_engine_pid(server, old: int) -> int:
    line = next(x for x in reversed(server.lines) if "the engine core is back" in x)
    pid = int(line.split("pid ")[1].split(")")[0])
    assert pid != old
    return pid


def test_dp2_server_matches_single_process_and_a_dead_rank_makes_it_unhealthy(ckpt_dir):
    path = ckpt_dir("v3")
    want = LLM(path, dtype="float32").generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    server = ServerProcess(path, "--dtype", "float32", "--data-parallel-size", "2", "--enable-expert-parallel",
                           "--distributed-timeout", "20", "--engine-restart-backoff", "0.5")
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
        ranks = _ranks(server)
        assert len(ranks) == 2, ranks  # the engine-core process started both rank processes
        os.kill(ranks[1], signal.SIGKILL)
        _wait_health(server, 503, 40)
        # the launcher starts a new engine core with new ranks; the API server reconnects
        _wait_health(server, 200, 180)
        server.engine_pid = _new_engine_pid(server, server.engine_pid)
        again = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert again.choices[0].text == want[0].outputs[0].text

        # A stopped rank while work is queued: /health 503 within seconds (--engine-stall-timeout 5), not
        # after --distributed-timeout: the API server sees the silence (engine_stalled) and the engine core
        # declares the stopped rank dead, whichever is first; the log names the rank, the engine is restarted
        # like a dead one, and the stream in flight is resumed on it (issue 31).
        body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(_ranks(server)[1], signal.SIGSTOP)
            assert _wait_health(server, 503, 10) < 10
            health = httpx.get(server.url + "/health").text
            assert "engine_stalled" in health or "is stopped (SIGSTOP" in health, health
            rest = [line for line in lines if line]  # resumed on the new engine: it ends normally
        assert not any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
        assert any("rank 1 (dp 1, tp 0) is stopped" in line for line in server.lines), server.lines[-10:]
        _wait_health(server, 200, 180)
        again = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert again.choices[0].text == want[0].outputs[0].text
    finally:
        server.stop()
