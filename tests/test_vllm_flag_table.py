"""Every flag of vLLM 0.32's `vllm serve --help=all` (tests/fixtures/vllm_serve_flags.txt) has a decision in
moeserve/entrypoints/vllm_flag_table.py, and the decision holds: implemented / mapped / no-effect flags parse
in `moeserve serve` under each of vLLM's spellings, refused ones fail with the table's reason in one line,
docs/from-vllm.md shows the same table. Also the mapped flags' translations and vLLM's flag syntax."""
from __future__ import annotations

import argparse
import logging
import os

import pytest

from moeserve.cli import build_parser, main, vllm_argv
from moeserve.config import ConfigError
from moeserve.entrypoints import vllm_flag_table as table
from moeserve.entrypoints.serve_cli import build_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "vllm_serve_flags.txt")


def _vllm_flags() -> list[tuple[list[str], str]]:
    rows = []
    with open(FIXTURE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                spellings, kind = line.rstrip("\n").split("\t")
                rows.append((spellings.split(), kind))
    return rows


VLLM_FLAGS = _vllm_flags()


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# a value each implemented / mapped flag's parser accepts (others get "1")
SAMPLE = {"--uvicorn-log-level": "info", "--log-level": "info", "--allowed-origins": '["x"]',
          "--allowed-methods": '["GET"]', "--allowed-headers": '["x"]', "--max-model-len": "32k",
          "--tool-call-parser": "deepseek_v3", "--reasoning-parser": "deepseek_r1"}


def test_the_fixture_is_vllms_full_list():
    assert len(VLLM_FLAGS) >= 300
    names = [s[0] for s, _ in VLLM_FLAGS]
    assert len(names) == len(set(names))
    for must in ("--trust-remote-code", "--data-parallel-size-local", "--headless", "--compilation-config",
                 "--enable-force-include-usage", "--kv-transfer-config"):
        assert must in names


def test_every_vllm_flag_has_a_decision():
    names = [s[0] for s, _ in VLLM_FLAGS]
    missing = [n for n in names if n not in table.TABLE]
    stale = [n for n in table.TABLE if n not in names]
    assert missing == [] and stale == []
    assert {d.decision for d in table.TABLE.values()} <= {table.IMPLEMENTED, table.MAPPED, table.NO_EFFECT,
                                                          table.REFUSED}
    for d in table.TABLE.values():
        assert d.decision == table.IMPLEMENTED or d.note, "every decision but 'implemented' says why"


@pytest.mark.parametrize("spellings,kind", [r for r in VLLM_FLAGS if table.TABLE[r[0][0]].decision != table.REFUSED],
                         ids=[r[0][0] for r in VLLM_FLAGS if table.TABLE[r[0][0]].decision != table.REFUSED])
def test_accepted_vllm_flag_parses_under_each_spelling(spellings, kind):
    """vLLM's short forms (-dpl, -asc, -n) and --no-X forms too. (A no-effect flag added by the table must
    parse the way vLLM's does: a value, a list, or none.)"""
    parser = _serve_parser()
    d = table.TABLE[spellings[0]]
    value = (d.allowed[0] if d.allowed else SAMPLE.get(spellings[0], "1"))
    for spelled in spellings:
        argv = [spelled] if kind in ("bool", "flag") or spelled.startswith("--no-") else [spelled, value]
        args, extras = parser.parse_known_args(argv)
        assert extras == [], (spelled, extras)


@pytest.mark.parametrize("name", [n for n, d in table.TABLE.items() if d.decision == table.REFUSED])
def test_refused_vllm_flag_says_why_in_one_line(name, capsys):
    d = table.TABLE[name]
    if name in {o for a in _serve_parser()._actions for o in a.option_strings}:
        # refused by value: the parser knows it so that the error can name what to do
        with pytest.raises(ValueError) as e:
            build_configs(build_parser().parse_args(["serve", name]))
        assert name in str(e.value)
        return
    for spelled in (name, *d.aliases):
        with pytest.raises(SystemExit) as e:
            main(["serve", spelled, "x"])
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert f"unknown flag {spelled} (vLLM's): {d.note}" in err
        assert "usage:" not in err and "did you mean" not in err and len(err.splitlines()) == 2


def test_several_refused_flags_one_line_each(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora", "--otlp-traces-endpoint", "http://x", "--tensor-paralel-size", "2"])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4
    assert "LoRA" in lines[0] and "OpenTelemetry" in lines[1] and "did you mean --tensor-parallel-size?" in lines[2]


NO_EFFECT_ADDED = [n for n, d in table.TABLE.items() if d.decision == table.NO_EFFECT
                   and n not in {"--async-scheduling", "--attention-backend"}]


@pytest.mark.parametrize("name", NO_EFFECT_ADDED)
def test_no_effect_flag_changes_nothing_and_says_why(name, caplog):
    d = table.TABLE[name]
    argv = [name] if d.kind in ("bool", "flag") else [name, d.allowed[0] if d.allowed else "1"]
    base = build_configs(build_parser().parse_args(["serve"]))
    with caplog.at_level(logging.INFO, logger="moeserve"):
        got = build_configs(build_parser().parse_args(["serve", *argv]))
    assert got[1] == base[1] and got[0].create_config(4096) == base[0].create_config(4096)
    assert f"{name} has no effect here: {d.note}" in caplog.text


@pytest.mark.parametrize("argv,words", [(["-pp", "2"], "--pipeline-parallel-size 2: pipeline parallelism"),
                                        (["--stream-interval", "4"], "--stream-interval 4"),
                                        (["--runner", "pooling"], "accepted values: auto, generate"),
                                        (["--distributed-executor-backend", "ray"], "mp, uni, external_launcher")])
def test_no_effect_flag_refuses_a_value_it_cannot_honour(argv, words):
    with pytest.raises(ValueError) as e:
        build_configs(build_parser().parse_args(["serve", *argv]))
    assert words in str(e.value)


def test_docs_flag_section_is_the_table():
    path = os.path.join(ROOT, "docs", "from-vllm.md")
    with open(path) as f:
        text = f.read()
    assert table.render_doc(text) == text, \
        "docs/from-vllm.md is stale: python -m moeserve.entrypoints.vllm_flag_table --write docs/from-vllm.md"
    for name in table.TABLE:
        assert f"`{name}`" in text


def _config(argv: list[str]):
    args = build_parser().parse_args(["serve", *vllm_argv(argv)])
    engine, server = build_configs(args)
    return engine.create_config(65536), server


@pytest.mark.parametrize("argv,expected", [
    # vLLM's multi-node DP (docs/from-vllm.md): node 0 and node 1 of a 2-node DP=4 deployment
    (["-dp", "4", "-ep", "--data-parallel-size-local", "2", "--data-parallel-address", "10.0.0.1",
      "--data-parallel-rpc-port", "13345"], {"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.1",
                                              "master_port": 13345}),
    (["-dp", "4", "-ep", "--headless", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpp", "13345"],
     {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 13345}),
    (["-dp", "8", "-dpl", "2", "-dpr", "6", "-dpa", "h0", "--headless"],
     {"nnodes": 4, "node_rank": 3, "master_port": 29550}),
    (["-dp", "2", "-dpl", "2"], {"nnodes": 1, "node_rank": 0}),
    (["-n", "2", "-r", "1", "-dp", "2", "--master-port", "20000"], {"nnodes": 2, "node_rank": 1}),
    (["--distributed-timeout-seconds", "30"], {"distributed_timeout": 30.0}),
    (["--cpu-distributed-timeout-seconds", "45"], {"distributed_timeout": 45.0}),
])
def test_multi_node_and_timeout_flags_map_onto_moeserves(argv, expected):
    config, _ = _config(argv)
    for key, want in expected.items():
        assert getattr(config.parallel, key) == want, key


@pytest.mark.parametrize("argv,words", [
    (["-dp", "4", "-dpl", "3"], "--data-parallel-size-local 3 must divide --data-parallel-size 4"),
    (["-dp", "4", "-dpl", "2", "-dpr", "1"], "must be a multiple of --data-parallel-size-local 2"),
    (["-dp", "4", "-dpl", "2", "--headless"], "--headless: this node holds DP rank 0"),
    (["-dp", "4", "-dpl", "2", "--nnodes", "4"], "--nnodes 4 disagrees"),
    (["-dp", "4", "-dpl", "2", "-dpb", "ray"], "--data-parallel-backend ray"),
    (["--distributed-timeout-seconds", "30", "--distributed-timeout", "10"], "disagrees with --distributed-timeout"),
])
def test_multi_node_flags_that_do_not_fit_are_refused(argv, words):
    with pytest.raises((ValueError, ConfigError)) as e:
        _config(argv)
    assert words in str(e.value)


@pytest.mark.parametrize("argv,path,want", [
    (["--optimization-level", "0"], "model.enforce_eager", True),
    (["-O0"], "model.enforce_eager", True),
    (["--max-cudagraph-capture-size", "8"], "model.decode_graph_sizes", (1, 2, 4, 8)),
    (["-cc", '{"cudagraph_capture_sizes": [1, 4]}'], "model.decode_graph_sizes", (1, 4)),
    (["--compilation-config.cudagraph_capture_sizes+", "1,2,4"], "model.decode_graph_sizes", (1, 2, 4)),
    (["--compilation-config.max_cudagraph_capture_size", "4"], "model.decode_graph_sizes", (1, 2, 4)),
    (["--num-gpu-blocks-override", "100"], "cache.num_kv_blocks", 100),
    (["--device-memory-utilization", "0.5"], "cache.gpu_memory_utilization", 0.5),
    (["--spec-method", "mtp", "--spec-tokens", "2"], "speculative.num_speculative_tokens", 2),
    (["--speculative-config.method", "deepseek_mtp", "--speculative-config.num_speculative_tokens", "2"],
     "speculative.num_speculative_tokens", 2),
    (["--speculative-config.method=mtp"], "speculative.method", "mtp"),
    (["--max_model_len", "32k", "--max_num_seqs=8"], "scheduler.max_model_len", 32000),
    (["--max_num_seqs=8"], "scheduler.max_num_seqs", 8),
])
def test_mapped_flags_and_vllm_syntax(argv, path, want):
    config, _ = _config(argv)
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    assert value == want


def test_api_server_count_short_form():
    _, server = _config(["-asc", "2"])
    assert server.api_server_count == 2


@pytest.mark.parametrize("argv,words", [
    (["--optimization-level", "3", "--compilation-config", '{"mode": 0}'], "--optimization-level 3 disagrees"),
    (["--spec-tokens", "2", "-sc", '{"method": "mtp", "num_speculative_tokens": 1}'], "--spec-tokens 2 disagrees"),
    (["--speculative-config", '{"method": "mtp"}', "--speculative-config.num_speculative_tokens", "2"],
     "given both whole and as dotted keys"),
    (["--num-gpu-blocks-override", "10", "--num-kv-blocks", "20"], "disagrees with --num-kv-blocks"),
])
def test_mapped_flags_that_disagree_are_refused(argv, words):
    with pytest.raises((ValueError, ConfigError)) as e:
        _config(argv)
    assert words in str(e.value)


def test_argparse_errors_are_one_line_without_usage(capsys):
    """A flag without its value, or a bad choice: the one line that matters, no usage dump."""
    for argv in (["serve", "--data-parallel-address"], ["serve", "--uvicorn-log-level", "loud"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage:" not in err and len(err.splitlines()) == 2, err
        assert err.startswith("moeserve serve: error: argument ")


def test_dotted_flag_errors_are_one_line(capsys):
    assert main(["serve", "--speculative-config.method"]) == 2
    assert "--speculative-config.method needs a value" in capsys.readouterr().err


def test_vllm_argv_leaves_values_alone():
    assert vllm_argv(["generate", "--prompt", "a_b.c", "--max_tokens", "4"]) == \
        ["generate", "--prompt", "a_b.c", "--max-tokens", "4"]
    assert vllm_argv(["serve", "--", "--x_y"]) == ["serve", "--", "--x_y"]


@pytest.mark.parametrize("argv,logged", [
    (["--eplb-config", '{"window_size": 1000, "step_interval": 3000, "log_balancedness": true}', "-ep", "-dp", "2"],
     ["--eplb-config window_size has no effect here", "--eplb-config log_balancedness has no effect here"]),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_buffer_device": "cuda", '
      '"kv_secret": "0123456789abcdef0123"}'], ["--kv-transfer-config kv_buffer_device has no effect here"]),
    (["--speculative-config.method", "mtp", "--speculative-config.draft_tensor_parallel_size", "1",
      "--speculative-config.enforce_eager", "true"],
     ["--speculative-config draft_tensor_parallel_size 1: the MTP layers run on the target's ranks",
      "--speculative-config enforce_eager has no effect here"]),
])
def test_vllm_config_keys_without_effect_are_accepted_and_logged(argv, logged, caplog, monkeypatch):
    from moeserve import vllm_values
    monkeypatch.setattr(vllm_values, "_LOGGED_NOTES", set())
    with caplog.at_level(logging.INFO, logger="moeserve"):
        _config(argv)
    for words in logged:
        assert words in caplog.text


def test_pd_without_nixl_names_the_extra(tmp_path):
    """--kv-transfer-config where NIXL cannot be imported: a config error naming `pip install 'moeserve[pd]'`
    (a fresh process with the NIXL packages blocked from import), not a failure in the engine process."""
    import subprocess
    import sys
    code = ("import sys\n"
            "for n in ('nixl', 'nixl_cu13', 'nixl_cu12'): sys.modules[n] = None\n"
            "from moeserve.cli import main\n"
            "sys.exit(main(['serve', '--kv-transfer-config', "
            "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\", \"kv_secret\": \"0123456789abcdef01\"}']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "NIXL, which is not installed: pip install 'moeserve[pd]'" in run.stderr
