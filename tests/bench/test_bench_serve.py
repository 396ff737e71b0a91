"""`moeserve bench serve` against a live `moeserve serve` writes every figure (and a plot)."""
from __future__ import annotations

import json

import pytest

from moeserve.cli import main

FIGURES = ["completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
           "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
           "output_throughput_per_device"]
FIGURES += [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
            for stat in ("mean", "median", "std", "p90", "p99")]


def test_bench_serve_random_writes_every_metric(openai_server, ckpt_dir, tmp_path):
    out, png = tmp_path / "result.json", tmp_path / "lat.png"
    rc = main(["bench", "serve", "--base-url", openai_server.url, "--model", "v3", "--dataset", "random",
               "--input-len", "16", "--output-len", "6", "--range-ratio", "0.5", "--num-prompts", "12",
               "--request-rate", "40", "--max-concurrency", "6", "--seed", "1", "--ignore-eos",
               "--ttft-slo-ms", "60000", "--tpot-slo-ms", "60000", "--num-devices", "2",
               "--result-json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    missing = [k for k in FIGURES if k not in r]
    assert not missing
    assert r["completed"] == 12 and r["failed"] == 0
    # ignore_eos: every request generates exactly its sampled output length (6 * (1 +- 0.5)).
    assert all(3 <= n <= 9 for n in r["output_lens"]) and r["total_output_tokens"] == sum(r["output_lens"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
    assert r["output_throughput_per_device"] == pytest.approx(r["output_throughput"] / 2)
    assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_sharegpt_chat_and_strict_slo(openai_server, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"please write a function number {i} in python"},
                               {"from": "gpt", "value": "def f(x):\n    return x + 1  # done " * 2}]}
            for i in range(6)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", openai_server.url, "--model", "v3", "--dataset", "sharegpt",
               "--dataset-path", str(path), "--num-prompts", "4", "--output-len", "4",
               "--endpoint", "/v1/chat/completions", "--ignore-eos", "--ttft-slo-ms", "0.001",
               "--result-json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["output_lens"] == [4] * 4
    assert r["request_goodput"] == 0.0  # nobody meets a 1 us TTFT


def test_bench_serve_bad_flags_fail_clearly(openai_server, capsys):
    assert main(["bench", "serve", "--base-url", openai_server.url, "--model", "v3",
                 "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().err
    for flags, name in ((["--input-len", "0"], "--input-len"), (["--output-len", "-3"], "--output-len"),
                        (["--range-ratio", "1.5"], "--range-ratio")):
        assert main(["bench", "serve", "--base-url", openai_server.url, "--model", "v3", *flags]) == 2
        assert name in capsys.readouterr().err


def test_bench_serve_against_no_server_says_why(ckpt_dir, capsys):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "v3",
                 "--tokenizer", ckpt_dir("v3"), "--num-prompts", "2", "--no-progress"]) == 1
    assert "every request failed; the first error: ConnectError" in capsys.readouterr().err


def test_bench_serve_shared_prefix_reports_the_prefix_cache(openai_server, tmp_path):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "serve", "--base-url", openai_server.url, "--model", "v3", "--dataset", "random",
               "--random-prefix-len", "96", "--input-len", "8", "--output-len", "2", "--num-prompts", "6",
               "--max-concurrency", "1", "--seed", "3", "--ignore-eos", "--result-json", str(out),
               "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert all(n >= 96 for n in r["input_lens"])
    # every prompt after the first finds (most of) the 96-token prefix cached
    assert 0.5 < r["prefix_cache_hit_rate"] < 1 and r["prefix_cache_hits"] >= 5 * 64
