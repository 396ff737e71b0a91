"""vLLM's DeepSeek recipe command lines run unchanged (issue 33): `vllm serve deepseek-ai/DeepSeek-V3 ...`
with `moeserve` for `vllm`, the model given by its Hugging Face id from a populated cache (the bundled model's
files in a hub cache layout written in a tmp dir, HF_HUB_OFFLINE=1). Each line resolves to the engine and
server configuration it asks for; the MTP line also starts a real server that answers by the id."""
from __future__ import annotations

import os
import shlex

import httpx
import pytest

from moeserve.cli import build_parser, vllm_argv
from moeserve.config_file import expand_config_file
from moeserve.engine.resolve import resolve_engine_config
from moeserve.entrypoints.serve_cli import build_configs
from moeserve.arch import DeepseekArch
from moeserve.models.default import default_model_path
from tests.entrypoints.server import ServerProcess
from tests.entrypoints.test_hf_model_ids import populate_hub_cache

REPO = "deepseek-ai/DeepSeek-V3"
MTP = """vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --max-model-len 1024
  --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' --async-scheduling"""
# (the recipe line, {config attribute path: expected})
RECIPES = [
    ("vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code -tp 2",
     {"parallel.tensor_parallel_size": 2}),
    (MTP, {"speculative.method": "mtp", "speculative.num_speculative_tokens": 1, "scheduler.max_model_len": 1024}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --speculative-config
        '{"method": "deepseek_mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 2}' -tp 2""",
     {"speculative.method": "mtp", "parallel.tensor_parallel_size": 2}),
    ("vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code -dp 2 --enable-expert-parallel",
     {"parallel.data_parallel_size": 2, "parallel.enable_expert_parallel": True}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --data-parallel-size 2 --enable-expert-parallel
        --enable-eplb --eplb-config '{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 2,
        "log_balancedness": false}' --all2all-backend deepep_low_latency""",
     {"parallel.enable_eplb": True, "parallel.eplb_step_interval": 3000, "parallel.num_redundant_experts": 2,
      "parallel.moe_comm": "alltoall"}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --port 8100
        --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'""",
     {"kv_transfer.kv_connector": "nixl", "kv_transfer.kv_role": "kv_producer"}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --port 8200
        --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'""",
     {"kv_transfer.kv_role": "kv_consumer"}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --data-parallel-size 4 --data-parallel-size-local 2
        --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345 --enable-expert-parallel""",
     {"parallel.nnodes": 2, "parallel.node_rank": 0, "parallel.master_addr": "10.0.0.1",
      "parallel.master_port": 13345}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --data-parallel-size 4 --data-parallel-size-local 2
        --headless --data-parallel-start-rank 2 --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345
        --enable-expert-parallel""",
     {"parallel.nnodes": 2, "parallel.node_rank": 1}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --max-model-len 2k --max-num-batched-tokens 8k
        --max-num-seqs 64 --gpu-memory-utilization 0.9 --block-size 64 --kv-cache-dtype fp8 --enable-prefix-caching
        --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}'
        --async-scheduling --attention-backend FLASHMLA --disable-log-stats""",
     {"scheduler.max_model_len": 2000, "cache.block_size": 64, "cache.cache_dtype": "fp8",
      "model.decode_graph_sizes": (1, 2, 4, 8)}),
    ("""vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code -O3 --enable-expert-parallel -dp 2
        --speculative-config.method mtp --speculative-config.num_speculative_tokens 2 --served-model-name ds""",
     {"speculative.num_speculative_tokens": 2, "model.enforce_eager": False}),
]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    snapshot = populate_hub_cache(cache, REPO, default_model_path())
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOESERVE_KV_SECRET", "recipe-test-secret-0123456789")  # PD's deployment secret
    return snapshot


def _serve_argv(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    return words[2:]


@pytest.mark.parametrize("line,expected", RECIPES, ids=[str(i) for i in range(len(RECIPES))])
def test_recipe_line_resolves_unchanged(hub, line, expected):
    argv = vllm_argv(expand_config_file(["serve", *_serve_argv(line)]))
    engine, server = build_configs(build_parser().parse_args(argv))
    assert os.path.realpath(engine.model) == os.path.realpath(hub)
    assert server.served_model_name == ("ds" if "--served-model-name" in line else REPO)
    config = resolve_engine_config(engine, DeepseekArch.from_pretrained(engine.model).max_position_embeddings)
    for path, want in expected.items():
        value = config
        for part in path.split("."):
            value = getattr(value, part)
        assert value == want, path


def test_the_mtp_recipe_serves_by_its_id(hub):
    argv = _serve_argv(MTP)
    assert argv[0] == REPO
    server = ServerProcess(REPO, *argv[1:])  # ServerProcess puts the model first
    try:
        r = httpx.post(server.base_url + "/completions", json={"model": REPO, "prompt": "def fib(n):",
                                                               "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == REPO and r.json()["usage"]["completion_tokens"] == 8
        assert server.wait_metric("vllm:spec_decode_num_drafts_total", lambda v: v > 0) > 0
        assert any("--trust-remote-code has no effect here" in line for line in server.lines)
        # the resolved configuration at start, as vLLM logs it
        (start,) = [line for line in server.lines if "engine with config: " in line]
        for words in (f"served_model_name=['{REPO}']", "speculative_config=mtp(num_speculative_tokens=1)",
                      "tensor_parallel_size=1", "data_parallel_size=1", "max_seq_len=1024", "quantization=None"):
            assert words in start, start
    finally:
        server.stop()
