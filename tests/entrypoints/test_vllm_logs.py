"""Logs as a vLLM operator reads them: request logs behind --enable-log-requests, and a clean stop
(SIGTERM) that logs no WARNING or ERROR line."""
from __future__ import annotations

import openai
import pytest

from tests.entrypoints.server import ServerProcess


# DP: a clean stop logged two "client ... unreachable; dropping it" WARNINGs (issue 31; the race itself is
# reproduced deterministically in test_clean_stop.py)
@pytest.mark.parametrize("extra", [(), ("--data-parallel-size", "2", "--enable-expert-parallel",
                                        "--api-server-count", "2")], ids=["single", "dp2"])
def test_request_logs_and_quiet_shutdown(ckpt_dir, extra):
    server = ServerProcess(ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32", "--enable-log-requests",
                           *extra)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt="hello there", max_tokens=3, temperature=0.5)
    finally:
        server.stop()
    text = "".join(server.lines)
    assert "Received request cmpl-" in text and "temperature=0.5" in text and "max_tokens=3" in text
    assert "Finished request cmpl-" in text and "output tokens: 3" in text
    noisy = [line for line in server.lines if " ERROR " in line or " WARNING " in line or "Traceback" in line]
    assert not noisy, noisy
