"""vLLM's flag spellings and value syntax, one generated test per row of VLLM_FLAGS (docs/from-vllm.md)."""
from __future__ import annotations

import pytest

from moeserve.cli import build_parser, main
from moeserve.config import ConfigError
from moeserve.engine_args import EngineArgs
from moeserve.entrypoints.serve_cli import build_configs

# (flags as a vLLM user types them, {"engine."/"server."/"config." attribute path: expected value})
VLLM_FLAGS = [
    (["-tp", "2"], {"engine.tensor_parallel_size": 2}),
    (["-dp", "4"], {"engine.data_parallel_size": 4}),
    (["-ep"], {"engine.enable_expert_parallel": True}),
    (["-q", "a8w8"], {"engine.quantization": "a8w8"}),
    (["-sc", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'], {"config.speculative.method": "mtp"}),
    (["--max-model-len", "32k"], {"engine.max_model_len": 32000}),
    (["--max-model-len", "32K"], {"engine.max_model_len": 32768}),
    (["--max-model-len", "auto"], {"engine.max_model_len": None}),
    (["--max-model-len", "-1"], {"engine.max_model_len": None}),
    (["--max-num-batched-tokens", "8k"], {"engine.max_num_batched_tokens": 8000}),
    (["--kv-cache-dtype", "auto"], {"config.cache.cache_dtype": "auto"}),
    (["--kv-cache-dtype", "fp8"], {"config.cache.cache_dtype": "fp8"}),
    (["--kv-cache-dtype", "fp8_e4m3", "--dtype", "bfloat16"], {"config.cache.cache_dtype": "fp8_e4m3"}),
    (["-q", "fp8"], {"engine.quantization": "fp8"}),
    (["--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16"], {"config.cache.cache_dtype": "bfloat16"}),
    (["--gpu-memory-utilization", "0.9"], {"config.cache.gpu_memory_utilization": 0.9}),
    (["--kv-cache-memory-bytes", "2G"], {"config.cache.kv_cache_memory": 2 << 30}),
    (["--load-format", "dummy"], {"config.model.load_format": "dummy"}),
    (["--enforce-eager"], {"engine.enforce_eager": True, "config.model.enforce_eager": True}),
    (["--skip-tokenizer-init"], {"config.model.skip_tokenizer_init": True}),
    (["--max-logprobs", "5"], {"config.model.max_logprobs": 5}),
    (["--logprobs-mode", "raw_logprobs"], {"config.model.logprobs_mode": "raw_logprobs"}),
    (["--logprobs-mode", "processed_logits"], {"config.model.logprobs_mode": "processed_logits"}),
    (["--scheduling-policy", "priority"], {"config.scheduler.policy": "priority"}),
    (["--eplb-config", '{"step_interval": 500, "num_redundant_experts": 2}', "-ep", "-dp", "2"],
     {"config.parallel.eplb_step_interval": 500, "config.parallel.num_redundant_experts": 2}),
    (["--all2all-backend", "allgather_reducescatter"], {"config.parallel.moe_comm": "allgather"}),
    (["--all2all-backend", "deepep_low_latency", "-ep", "-dp", "2"], {"config.parallel.moe_comm": "alltoall"}),
    (["--override-generation-config", '{"temperature": 0.5}'],
     {"engine.override_generation_config": '{"temperature": 0.5}'}),
    (["--disable-log-stats"], {"engine.disable_log_stats": True}),
    (["--max-num-queued-reqs", "100"], {"server.max_num_queued_reqs": 100}),
    (["--served-model-name", "a", "b"], {"server.served_model_name": "a", "server.served_model_aliases": ("b",)}),
    (["--enable-log-requests"], {"server.enable_log_requests": True}),
    (["--uvicorn-log-level", "info"], {"server.uvicorn_log_level": "info"}),
    (["--root-path", "/llm"], {"server.root_path": "/llm"}),
    (["--allowed-origins", '["https://ui.example"]'], {"server.allowed_origins": ("https://ui.example",)}),
    (["--ssl-cert-reqs", "0"], {"server.ssl_cert_reqs": 0}),
    (["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v31"], {"server.tool_call_parser": "deepseek_v31"}),
    (["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v32"], {"server.tool_call_parser": "deepseek_v32"}),
    # vLLM recipe flags (issue 33)
    (["--dtype", "half"], {"config.model.dtype": "float16"}),
    (["--dtype", "float"], {"config.model.dtype": "float32"}),
    (["--cudagraph-capture-sizes", "1", "2", "4"],
     {"config.model.decode_graph_sizes": (1, 2, 4), "config.model.enforce_eager": False}),
    (["-O", "3", "--cudagraph-capture-sizes", "8", "1"], {"config.model.decode_graph_sizes": (1, 8)}),
    (["--compilation-config", '{"cudagraph_capture_sizes": [2, 4]}', "--cudagraph-capture-sizes", "2", "4"],
     {"config.model.decode_graph_sizes": (2, 4)}),
    (["--trust-remote-code"], {"engine.trust_remote_code": True}),
    # vLLM's ops flags (tests/entrypoints/test_vllm_ops_flags.py runs them against a server)
    (["--max-log-len", "100"], {"server.max_log_len": 100}),
    (["--disable-uvicorn-access-log", "--uvicorn-log-level", "info"], {"server.disable_uvicorn_access_log": True}),
    (["--enable-prompt-tokens-details"], {"server.enable_prompt_tokens_details": True}),
    (["--no-enable-prompt-tokens-details"], {"server.enable_prompt_tokens_details": False}),
    (["--enable-force-include-usage"], {"server.enable_force_include_usage": True}),
    (["--enable-request-id-headers"], {"server.enable_request_id_headers": True}),
    (["--disable-fastapi-docs"], {"server.disable_fastapi_docs": True}),
    (["--response-role", "model"], {"server.response_role": "model"}),
    (["--return-tokens-as-token-ids"], {"server.return_tokens_as_token_ids": True}),
    # vLLM's value spellings (issue 33): its connector name and keys, its EPLB example, its MTP keys
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": '
      '"cuda", "kv_connector_extra_config": {"backends": ["UCX"]}, "kv_load_failure_policy": "fail", '
      '"kv_port": 14579, "kv_secret": "0123456789abcdef0123"}'],
     {"config.kv_transfer.kv_connector": "nixl", "config.kv_transfer.kv_role": "kv_producer",
      "config.kv_transfer.kv_port": 14579}),
    (["--eplb-config", '{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 2, '
      '"log_balancedness": true}', "-ep", "-dp", "2", "--enable-eplb"],
     {"config.parallel.eplb_step_interval": 3000, "config.parallel.num_redundant_experts": 2}),
    (["-sc", '{"method": "deepseek_mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}'],
     {"config.speculative.method": "mtp", "config.speculative.num_speculative_tokens": 2}),
    (["-tp", "2", "-sc", '{"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 2, '
      '"enforce_eager": true, "max_model_len": 4096, "rejection_sample_method": "standard"}'],
     {"config.speculative.num_speculative_tokens": 1}),
]

# (flags, words the error must contain)
REFUSED = [
    (["--kv-cache-dtype", "fp8_e5m2"], "FP8 KV-cache storage is e4m3 only"),
    (["--kv-cache-dtype", "bfloat16", "--dtype", "float32"], "differs from --dtype float32"),
    (["--logprobs-mode", "processed_logit"], "--logprobs-mode must be one of"),
    (["--max-logprobs", "50"], "--max-logprobs must be in 0..20"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--all2all-backend", "magic"], "--all2all-backend must be one of"),
    (["--all2all-backend", "allgather_reducescatter", "--moe-comm", "alltoall", "-ep", "-dp", "2"],
     "means --moe-comm allgather"),
    (["--eplb-config", '{"window_size": -1}'], "window_size must be a positive integer"),
    # vLLM's value spellings that moeserve cannot honour (issue 33)
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
     "moeserve moves KV over NIXL only; use \"NixlConnector\""),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_load_failure_policy": "recompute"}'],
     "recompute is not supported"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_connector_module_path": "my.mod"}'],
     "kv_connector_module_path"),
    (["-sc", '{"method": "mtp", "model": "someone/draft-model"}'], "not a separate draft model"),
    (["-sc", '{"method": "mtp", "draft_tensor_parallel_size": 4}'], "the MTP layers run on the target's ranks"),
    (["-sc", '{"method": "mtp", "quantization": "fp8"}'], "quantized as the target is"),
    (["-sc", '{"method": "mtp", "rejection_sample_method": "probabilistic"}'], "rejection_sample_method"),
    (["-sc", '{"method": "mtp", "prompt_lookup_max": 4}'], "unknown key(s) prompt_lookup_max"),
    (["--eplb-config", '{"colour": 1}'], "unknown key"),
    (["--scheduling-policy", "lifo"], "--scheduling-policy must be one of"),
    (["--load-format", "pt"], "--load-format must be one of"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode must be one of"),
    (["--hf-overrides", '{"num_hidden_layers": 2}'], "--hf-overrides"),
    (["--compilation-config", '{"cudagraph_capture_sizes": [4]}', "--cudagraph-capture-sizes", "1"],
     "--cudagraph-capture-sizes [1] disagrees with --compilation-config"),
]

# vLLM recipe / ops flags accepted without effect: they parse, change neither config, and log why (INFO)
NO_EFFECT = [
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--async-scheduling"], "--async-scheduling"),
    (["--attention-backend", "FLASHMLA"], "--attention-backend"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode"),
    (["--hf-overrides", "{}"], "--hf-overrides"),
]


def _configs(flags: list[str]):
    args = build_parser().parse_args(["serve", *flags])
    engine, server = build_configs(args)
    config = engine.create_config(65536)
    return {"engine": engine, "server": server, "config": config}


def _get(objs: dict, path: str):
    head, *rest = path.split(".")
    value = objs[head]
    for part in rest:
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("flags,expected", VLLM_FLAGS, ids=[" ".join(f) for f, _ in VLLM_FLAGS])
def test_vllm_spelling_is_understood(flags, expected):
    objs = _configs(flags)
    for path, want in expected.items():
        assert _get(objs, path) == want, path


@pytest.mark.parametrize("flags,words", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_unsupported_value_is_refused_clearly(flags, words):
    with pytest.raises((ConfigError, ValueError)) as e:
        _configs(flags)
    assert words in str(e.value)


@pytest.mark.parametrize("typo,suggestion", [("--tensor-paralel-size", "--tensor-parallel-size"),
                                             ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
                                             ("--enable-expert-paralel", "--enable-expert-parallel")])
def test_unknown_flag_names_the_closest(typo, suggestion, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", typo, "1"])
    assert e.value.code == 2
    assert f"did you mean {suggestion}?" in capsys.readouterr().err


@pytest.mark.parametrize("flag,words", [("--data-parallel-rank", "moeserve proxy"),
                                        ("--enable-lora", "LoRA"),
                                        ("--otlp-traces-endpoint", "OpenTelemetry")])
def test_vllm_flag_without_a_match_says_what_to_use(flag, words, capsys):
    """vLLM flags moeserve refuses go by a table, not by spelling; the error is short (no usage dump)."""
    with pytest.raises(SystemExit) as e:
        main(["serve", flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unknown flag {flag} (vLLM's): " in err and words in err
    assert "did you mean" not in err and "usage:" not in err and len(err.splitlines()) == 2


def test_config_yaml_flags_and_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_model_len: 32k\ntensor-parallel-size: 2\nenable_prefix_caching: false\n"
                   "served_model_name: [x, y]\nspeculative_config: {method: mtp, num_speculative_tokens: 1}\n"
                   "max_num_seqs: 8\n")
    from moeserve.config_file import expand_config_file
    argv = expand_config_file(["serve", "--config", str(cfg), "--max-num-seqs", "4"])
    engine, server = build_configs(build_parser().parse_args(argv))
    assert (engine.max_model_len, engine.tensor_parallel_size, engine.enable_prefix_caching) == (32000, 2, False)
    assert engine.max_num_seqs == 4  # the command line wins over the file
    assert server.served_model_names == ("x", "y")
    assert '"num_speculative_tokens": 1' in engine.speculative_config


def test_config_file_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "mapping of flag names" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2


def test_engine_args_keywords_match_flags():
    """Every new vLLM flag is also an LLM() keyword (EngineArgs field), as in vLLM."""
    for name in ("kv_cache_dtype", "gpu_memory_utilization", "load_format", "enforce_eager", "skip_tokenizer_init",
                 "max_logprobs", "logprobs_mode", "scheduling_policy", "eplb_config", "all2all_backend",
                 "override_generation_config", "kv_cache_memory_bytes", "disable_log_stats"):
        assert name in EngineArgs.field_names()


def test_dsml_tool_calls_parse():
    """deepseek_v32's DSML block: string parameters as text, the others as JSON."""
    from moeserve.entrypoints.tool_calls import StreamedContent, parse_deepseek_v3
    text = ('Let me check.<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    content, calls = parse_deepseek_v3(text)
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == \
        [("get_weather", '{"city": "Paris", "days": 3}')]
    streamed = StreamedContent()
    sent = "".join(streamed.push(ch) for ch in text)
    assert sent == "Let me check." and streamed.finish()[1] == calls


@pytest.mark.parametrize("flags,logged", NO_EFFECT, ids=[" ".join(f) for f, _ in NO_EFFECT])
def test_recipe_flag_without_effect_is_accepted_and_logged(flags, logged, caplog, monkeypatch):
    import logging
    from moeserve import vllm_values
    monkeypatch.setattr(vllm_values, "_LOGGED_NOTES", set())
    base = _configs([])
    with caplog.at_level(logging.INFO, logger="moeserve"):
        objs = _configs(flags)
    assert objs["config"] == base["config"]
    assert objs["server"] == base["server"]
    if logged:
        assert any(r.getMessage().startswith(logged) for r in caplog.records), caplog.text


def test_trust_remote_code_everywhere(tmp_path):
    """--trust-remote-code in serve, generate, a YAML --config and LLM(): accepted, and it runs no code."""
    from moeserve import LLM
    from moeserve.config_file import expand_config_file
    from moeserve.entrypoints.generate_cli import engine_args_for
    assert _configs(["--trust-remote-code"])["engine"].trust_remote_code
    gen = engine_args_for(build_parser().parse_args(["generate", "--trust-remote-code"]), 1)
    assert gen.trust_remote_code
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text("trust_remote_code: true\nasync_scheduling: true\n")
    engine, _ = build_configs(build_parser().parse_args(expand_config_file(["serve", "--config", str(cfg)])))
    assert engine.trust_remote_code and engine.async_scheduling
    # LLM(): the keyword is known (only the bogus one is named); the engine never imports checkpoint code
    with pytest.raises(TypeError) as e:
        LLM(trust_remote_code=True, bogus_keyword=1)
    assert "bogus_keyword" in str(e.value) and "trust_remote_code" not in str(e.value)
    assert EngineArgs(trust_remote_code=True, dtype="half").dtype == "float16"


def test_generate_cudagraph_capture_sizes_compiles():
    """generate runs eagerly unless asked; --cudagraph-capture-sizes asks, as -O does."""
    from moeserve.entrypoints.generate_cli import engine_args_for
    args = engine_args_for(build_parser().parse_args(["generate", "--cudagraph-capture-sizes", "1", "2"]), 1)
    fields = args._compilation_fields()
    assert fields == {"enforce_eager": False, "decode_graph_sizes": (1, 2)}
    assert engine_args_for(build_parser().parse_args(["generate"]), 1)._compilation_fields()["enforce_eager"]


def test_dtype_half_runs_in_float16():
    """vLLM's --dtype half: the bundled model loads and generates in float16 (on CPU too)."""
    from moeserve import LLM, SamplingParams
    llm = LLM(dtype="half", trust_remote_code=True, max_model_len=256, enforce_eager=True)
    assert llm.config.model.dtype == "float16"
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
