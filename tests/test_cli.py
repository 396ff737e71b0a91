"""The `moeserve` command as users run it (a real subprocess)."""
import os
import subprocess
import sys

import pytest

from moeserve.config import EngineArgs


def run_cli(*args, timeout=180):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_prints_completion(ckpt_dir):
    r = run_cli("generate", "--model", ckpt_dir("v3"), "--prompt", "def f(x):", "--max-tokens", "5",
                "--dtype", "float32", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "def f(x):" in r.stdout and "5 tokens, finish_reason=length" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--dtype", "int4"], "--dtype must be one of"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--model", "/nonexistent/ckpt"], "not a local checkpoint folder"),
])
def test_bad_flags_get_one_clear_line(args, message):
    r = run_cli("generate", "--max-tokens", "2", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_every_engine_arg_is_a_flag_and_an_llm_keyword():
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    flags = {a.dest for a in p._actions}
    assert EngineArgs.field_names() - {"model"} <= flags
    ns = p.parse_args(["--max-num-seqs", "3", "--kv-cache-memory", "64M", "--no-enable-chunked-prefill"])
    args = EngineArgs.from_cli(ns, None)
    assert args.max_num_seqs == 3 and args.kv_cache_memory == 64 << 20 and args.enable_chunked_prefill is False


def test_kv_cache_memory_sizes_the_pool(ckpt_dir):
    from moeserve import LLM

    llm = LLM(ckpt_dir("v3"), dtype="float32", kv_cache_memory=1 << 20, block_size=16)
    arch = llm.arch
    per_block = 16 * arch.num_hidden_layers * arch.kv_cache_dim * 4
    assert llm.engine.runner.num_blocks == (1 << 20) // per_block
