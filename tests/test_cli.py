"""The `moeserve` command as users run it (a real subprocess)."""
import os
import re
import subprocess
import sys

import pytest

from moeserve.config import ConfigError

from moeserve.engine_args import EngineArgs


def _nccl_usable() -> bool:
    import torch
    import torch.distributed as dist
    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()


NCCL_USABLE = _nccl_usable()


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
    (["--model", "/nonexistent/ckpt"], "neither a local folder nor a Hugging Face repo id"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2, got 0"),  # not "0 = the model's maximum"
    (["--master-port", "99999"], "--master-port must be in 1..65535, got 99999"),
    (["--nnodes", "2", "--data-parallel-size", "2", "--master-port", "65535"], "--master-port must be in 1..65534"),
    pytest.param(["--data-parallel-size", "2", "--distributed-backend", "nccl"],
                 "--distributed-backend nccl: this torch", marks=pytest.mark.skipif(
                     NCCL_USABLE, reason="NCCL and a GPU are available here")),
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


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len="64"), "max_model_len (--max-model-len) must be an integer, got '64' (str)"),
    (dict(block_size=2.5), "block_size (--block-size) must be an integer, got 2.5 (float)"),
    (dict(max_num_seqs=True), "max_num_seqs (--max-num-seqs) must be an integer, got True (bool)"),
    (dict(enable_chunked_prefill="no"), "enable_chunked_prefill (--enable-chunked-prefill) must be True or False"),
    (dict(distributed_timeout="60"), "distributed_timeout (--distributed-timeout) must be a number"),
])
def test_llm_keyword_types_are_checked(ckpt_dir, kwargs, message):
    from moeserve import LLM

    with pytest.raises(ConfigError) as e:
        LLM(ckpt_dir("v3"), dtype="float32", **kwargs)
    assert message in str(e.value)


def test_max_model_len_zero_is_refused_and_none_is_the_model_maximum():
    with pytest.raises(ConfigError, match="--max-model-len must be >= 2, got 0"):
        EngineArgs(model="m", max_model_len=0).create_config(512)
    assert EngineArgs(model="m", distributed_timeout=5).create_config(512).scheduler.max_model_len == 512


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["eval-quant"], ["quantize"], ["bench", "serve"]])
def test_help_states_each_default_once(command, capsys):
    from moeserve.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default:" in text and not re.search(r"\(default: [^)]*\) \(default:", text)  # no "... (default: None)"
    if command == ["generate"]:
        assert "checkpoint folder (default: the bundled model) --config" in text


def test_every_help_entry_states_its_default():
    """vLLM users read defaults off --help: no flag of any subcommand is listed without one."""
    import argparse

    from moeserve.cli import build_parser

    def walk(parser, name):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for n, sp in a.choices.items():
                    yield from walk(sp, f"{name} {n}")
            elif a.option_strings and a.default is not argparse.SUPPRESS:
                text = sp_format(parser, a)
                if "default" not in text:
                    yield f"{name} {a.option_strings[0]}"

    def sp_format(parser, action):
        return parser._get_formatter()._get_help_string(action) if action.help else ""

    assert list(walk(build_parser(), "moeserve")) == []


@pytest.mark.parametrize("size", ["0", "-1"])
def test_quantize_refuses_a_shard_size_that_is_not_positive(ckpt_dir, tmp_path, capsys, size):
    from moeserve.cli import main

    assert main(["quantize", ckpt_dir("v3"), str(tmp_path / "out"), "--shard-size", size]) == 2
    assert "--shard-size must be a positive size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
