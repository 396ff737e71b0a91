"""EngineArgs: every field is both a CLI flag (`--max-num-seqs`, vLLM's spelling) and an
`LLM(max_num_seqs=...)` keyword, as in vLLM; create_config() validates them into the frozen EngineConfig
(config.py). The flags' help and value syntax are in engine_flags.py; vLLM's JSON-valued flags translated to
ours in vllm_values.py."""
from __future__ import annotations

import argparse
import dataclasses
import numbers
import typing
from dataclasses import dataclass

from moeserve.config import (ALL2ALL_BACKENDS, CacheConfig, ConfigError, EngineConfig, KVTransferConfig,
                             ModelConfig, ParallelConfig, QuantConfig, SchedulerConfig, SpeculativeConfig,
                             _parse_json_dict, _require, decode_graph_sizes_up_to)
from moeserve.engine_flags import (DTYPE_ALIASES, ENGINE_HELP, SHORT_FLAGS, TOKENIZER_MODES, _parse_len, _parse_size,
                                   human_readable_int)
from moeserve.vllm_values import (_CPU_GRAPHS_ARE_COMPILED, COMPILATION_KEYS, COMPILATION_KEYS_IGNORED,
                                  VLLM_DP_RPC_PORT, _eplb_fields, _vllm_kv_transfer, _vllm_speculative, nixl_installed,
                                  note_once)


def _check_field_types(args: "EngineArgs") -> None:
    """Integer, number and boolean options must be of that type (LLM keywords are not parsed by argparse)."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        value = getattr(args, f.name)
        if value is None and type(None) in kinds:
            continue
        if bool in kinds:
            ok, want = isinstance(value, bool), "True or False"
        elif int in kinds:
            ok, want = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
        elif float in kinds:
            ok, want = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
        else:
            continue
        _require(ok, f"{f.name} (--{f.name.replace('_', '-')}) must be {want}, "
                     f"got {value!r} ({type(value).__name__})")


@dataclass
class EngineArgs:
    """The flat list of engine options (CLI flags and LLM keywords)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    mla_decode: str = "standard"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    quantization: str | None = None  # "a8w8" | "fp8"; None = the checkpoint's own (compressed-tensors INT8) or none
    speculative_config: dict | str | None = None  # JSON string on the CLI, a dict from LLM(...)
    kv_transfer_config: dict | str | None = None  # JSON string on the CLI, a dict from LLM(...)
    moe_comm: str = "auto"
    moe_comm_dtype: str = "bfloat16"
    moe_comm_hierarchy: str = "flat"
    moe_node_size: int | None = None
    moe_pipeline_chunks: int = 1
    flashcomm: str = "off"
    attention_tp_dp_switch: bool = False
    num_redundant_experts: int = 0
    shared_expert_ranks: int = 0
    expert_placement: str | None = None
    expert_load_stats: str | None = None
    enable_eplb: bool = False
    eplb_step_interval: int = 3000
    enable_dbo: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_backend: str = "auto"
    distributed_timeout: float = 60.0
    enable_elastic_ep: bool = False
    elastic_ep_timeout: float = 60.0
    elastic_ep_hang_timeout: float = 20.0
    elastic_ep_replace: bool = False
    elastic_ep_host_copy: bool = False
    elastic_ep_graphs: str = "in-use-first"
    generation_config: str = "auto"  # request defaults: "auto" (the model's generation_config.json), "vllm", a folder
    # vLLM's spellings (docs/from-vllm.md); the translations happen in create_config
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # vLLM's name for --kv-cache-memory
    gpu_memory_utilization: float | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    compilation_config: dict | str | None = None  # vLLM's: JSON / dict, or a level 0-3 (also an int from LLM)
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    scheduling_policy: str = "fcfs"
    eplb_config: dict | str | None = None  # JSON: step_interval, num_redundant_experts (vLLM's EPLBConfig)
    all2all_backend: str | None = None  # vLLM's MoE backends -> --moe-comm
    override_generation_config: dict | str | None = None  # JSON merged over the generation_config defaults
    disable_log_stats: bool = False
    # vLLM recipe flags (issue 33); create_config logs which do nothing here
    trust_remote_code: bool = False  # never runs checkpoint code: the architectures are built in
    async_scheduling: bool = False
    attention_backend: str | None = None
    tokenizer_mode: str = "auto"
    revision: str | None = None
    download_dir: str | None = None
    hf_overrides: dict | str | None = None
    cudagraph_capture_sizes: list | None = None  # -> compilation config's cudagraph_capture_sizes
    # vLLM flags mapped onto moeserve's in _apply_vllm_mappings (vllm_flag_table.py)
    data_parallel_size_local: int | None = None  # -> nnodes
    data_parallel_start_rank: int | None = None  # -> node_rank
    data_parallel_address: str | None = None  # -> master_addr
    data_parallel_rpc_port: int | None = None  # -> master_port
    data_parallel_backend: str = "mp"
    distributed_timeout_seconds: float | None = None  # -> distributed_timeout
    cpu_distributed_timeout_seconds: float | None = None  # -> distributed_timeout
    max_cudagraph_capture_size: int | None = None  # -> compilation config
    optimization_level: int | None = None  # -> compilation config mode
    num_gpu_blocks_override: int | None = None  # -> num_kv_blocks
    spec_method: str | None = None  # -> speculative_config
    spec_tokens: int | None = None  # -> speculative_config

    def __post_init__(self) -> None:
        _check_field_types(self)
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_cli_args(cls, parser, skip: tuple[str, ...] = ("model",)) -> None:
        """One flag per field: `max_num_seqs` -> `--max-num-seqs` (vLLM's names, with vLLM's short forms)."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name in skip or f.name.startswith("_"):
                continue
            flags = ["--" + f.name.replace("_", "-"), *SHORT_FLAGS.get(f.name, ())]
            kind = hints[f.name]
            text = ENGINE_HELP.get(f.name, " ")
            if kind is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=text)
            elif list in typing.get_args(kind):
                group.add_argument(*flags, type=human_readable_int, nargs="+", default=f.default, help=text)
            elif dict in typing.get_args(kind):
                group.add_argument(*flags, type=str, default=f.default, help=text)
            else:
                base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
                parse = _parse_size if f.name.endswith(("_memory", "_memory_bytes")) else \
                    _parse_len if f.name == "max_model_len" else human_readable_int if base is int else base
                group.add_argument(*flags, type=parse, default=f.default, help=text)

    @classmethod
    def from_cli(cls, ns, model: str | None) -> "EngineArgs":
        return cls(model=model, **{k: v for k, v in vars(ns).items() if k in cls.field_names() and k != "model"})

    def create_config(self, model_max_len: int, quant: QuantConfig | None = None) -> EngineConfig:
        """Validate into the frozen EngineConfig. Plain data: the checkpoint-dependent parts (the model
        folder, its context length, the quantization it implies) are resolved by the caller, see
        engine/resolve.py; without `quant` only --quantization counts."""
        _check_field_types(self)  # fields may have been set after construction
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        self._check_recipe_flags()
        self._apply_vllm_mappings()
        parallel = self._parallel_fields()
        _require(self.model is not None, "EngineArgs.model must be a checkpoint folder here "
                 "(engine/resolve.py resolve_engine_config resolves None to the bundled model)")
        # `is None`, not `or`: an explicit 0 is an error (SchedulerConfig), not the model's maximum.
        max_len = model_max_len if self.max_model_len is None else self.max_model_len
        _require(max_len <= model_max_len,
                 f"--max-model-len {max_len} exceeds the model's max_position_embeddings {model_max_len}")
        self._check_slo_layout()
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, tokenizer=self.tokenizer, seed=self.seed,
                              load_format=self.load_format, **self._compilation_fields(),
                              skip_tokenizer_init=self.skip_tokenizer_init, max_logprobs=self.max_logprobs,
                              logprobs_mode=self.logprobs_mode, mla_decode=self.mla_decode),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_cache_memory=self._kv_cache_memory(),
                              enable_prefix_caching=self.enable_prefix_caching,
                              cache_dtype=self._cache_dtype(),
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=max_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms,
                                      policy=self.scheduling_policy),
            parallel=ParallelConfig(**parallel),
            quant=quant if quant is not None else QuantConfig(method=self.quantization),
            speculative=self.speculative(),
            kv_transfer=self._kv_transfer(),
        )

    def _check_recipe_flags(self) -> None:
        """vLLM recipe flags that have no effect here: refuse the values moeserve cannot honour, log the rest
        once per process (INFO)."""
        _require(self.tokenizer_mode in TOKENIZER_MODES, f"--tokenizer-mode must be one of "
                 f"{', '.join(TOKENIZER_MODES)} (moeserve loads the checkpoint's own tokenizer), "
                 f"got {self.tokenizer_mode!r}")
        overrides = self.hf_overrides
        if isinstance(overrides, str):
            overrides = _parse_json_dict(overrides, "--hf-overrides", "{}")
        _require(overrides is None or overrides == {}, "--hf-overrides: overriding the checkpoint's config.json "
                 f"is not supported yet (got keys {', '.join(map(str, overrides or {}))}); edit config.json in a "
                 "copy of the checkpoint folder instead")
        notes = {
            "trust_remote_code": (self.trust_remote_code, "the DeepSeek V2/V3 architectures are built into "
                                  "moeserve; no code from the checkpoint is run"),
            "async_scheduling": (self.async_scheduling, "moeserve's engine schedules each step after the last "
                                 "one's outputs"),
            "attention_backend": (self.attention_backend is not None, "MLA attention is moeserve's own "
                                  "(--mla-decode picks its decode kernel)"),
            "tokenizer_mode": (self.tokenizer_mode != "auto", "moeserve always loads the checkpoint's own "
                               "tokenizer (AutoTokenizer)"),
            "hf_overrides": (overrides == {}, "nothing to override"),
        }
        for name, (given, why) in notes.items():
            if given:
                note_once(name, "--%s has no effect here: %s", name.replace("_", "-"), why)

    def _apply_vllm_mappings(self) -> None:
        """vLLM flags that are other names for moeserve's: set moeserve's field (an explicit one must agree)."""
        def onto(src: str, value, dst: str, default) -> None:
            if value is None:
                return
            given = getattr(self, dst)
            _require(given in (default, value), f"--{src.replace('_', '-')} {value} disagrees with "
                     f"--{dst.replace('_', '-')} {given}; pass one")
            setattr(self, dst, value)

        for name in ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
            onto(name, None if value is None else float(value), "distributed_timeout", 60.0)
        onto("num_gpu_blocks_override", self.num_gpu_blocks_override, "num_kv_blocks", None)
        self._multi_node_dp()
        if self.spec_method is not None or self.spec_tokens is not None:
            value = self.speculative_config
            if isinstance(value, str):
                value = _parse_json_dict(value, "--speculative-config", '{"method": "mtp"}')
            value = dict(value or {})
            for key, given in (("method", self.spec_method), ("num_speculative_tokens", self.spec_tokens)):
                if given is not None:
                    _require(value.get(key, given) == given, f"--spec-{'method' if key == 'method' else 'tokens'} "
                             f"{given} disagrees with --speculative-config {key} {value.get(key)!r}; pass one")
                    value[key] = given
            value.setdefault("method", "mtp")
            self.speculative_config = value

    def _multi_node_dp(self) -> None:
        """vLLM's multi-node DP flags -> --nnodes / --node-rank / --master-addr / --master-port. vLLM runs
        --data-parallel-size-local DP ranks on each node, node i from DP rank i x local; moeserve runs the same
        command on every node with the ranks split evenly, node i holding the i-th share."""
        _require(self.data_parallel_backend == "mp", f"--data-parallel-backend {self.data_parallel_backend}: "
                 "moeserve spawns its rank processes itself (mp); Ray is not supported")
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if (local, start, self.data_parallel_address, self.data_parallel_rpc_port) == (None,) * 4:
            return
        dp = self.data_parallel_size
        local = dp if local is None else local
        _require(isinstance(local, int) and 1 <= local <= dp and dp % local == 0,
                 f"--data-parallel-size-local {local} must divide --data-parallel-size {dp}: moeserve runs the "
                 "same number of DP ranks on every node")
        start = 0 if start is None else start
        _require(isinstance(start, int) and 0 <= start < dp and start % local == 0,
                 f"--data-parallel-start-rank {start} must be a multiple of --data-parallel-size-local {local} "
                 f"below --data-parallel-size {dp} (node i starts at DP rank i x {local})")
        nnodes, node_rank = dp // local, start // local
        _require(self.nnodes in (1, nnodes), f"--nnodes {self.nnodes} disagrees with --data-parallel-size {dp} / "
                 f"--data-parallel-size-local {local} = {nnodes} nodes; pass one")
        _require(self.node_rank in (0, node_rank), f"--node-rank {self.node_rank} disagrees with "
                 f"--data-parallel-start-rank {start} / --data-parallel-size-local {local} = node {node_rank}")
        self.nnodes, self.node_rank = nnodes, node_rank
        if self.data_parallel_address is not None:
            _require(self.master_addr in ("127.0.0.1", self.data_parallel_address), f"--data-parallel-address "
                     f"{self.data_parallel_address} disagrees with --master-addr {self.master_addr}; pass one")
            self.master_addr = self.data_parallel_address
        port = self.data_parallel_rpc_port
        if port is None and nnodes > 1 and self.master_port is None:
            port = VLLM_DP_RPC_PORT
        if port is not None:
            _require(self.master_port in (None, port), f"--data-parallel-rpc-port {port} disagrees with "
                     f"--master-port {self.master_port}; pass one")
            self.master_port = port

    def _compilation_fields(self) -> dict:
        """--enforce-eager and vLLM's --compilation-config -> ModelConfig's enforce_eager, decode_graph_sizes."""
        eager, sizes = self.enforce_eager, None
        value = self.compilation_config
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, str):
            value = _parse_json_dict(value, "--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}')
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"mode": value}
        if self.optimization_level is not None or self.max_cudagraph_capture_size is not None:
            _require(isinstance(value, dict) or value is None, "--compilation-config must be a JSON object / dict "
                     f"or a level 0-3, got {type(value).__name__}")
            value = dict(value or {})
            for flag, key, given in (("--optimization-level", "mode", self.optimization_level),
                                     ("--max-cudagraph-capture-size", "max_cudagraph_capture_size",
                                      self.max_cudagraph_capture_size)):
                existing = value.get(key, value.get("level")) if key == "mode" else value.get(key)
                if given is not None:
                    _require(existing in (None, given),
                             f"{flag} {given} disagrees with --compilation-config {key} {existing!r}; pass one")
                    value[key] = given
        if self.cudagraph_capture_sizes is not None:
            sizes_given = list(self.cudagraph_capture_sizes)
            _require(isinstance(value, dict) or value is None, "--compilation-config must be a JSON object / dict "
                     f"or a level 0-3, got {type(value).__name__}")
            value = dict(value or {})
            _require(value.get("cudagraph_capture_sizes", sizes_given) == sizes_given,
                     f"--cudagraph-capture-sizes {sizes_given} disagrees with --compilation-config "
                     f"cudagraph_capture_sizes {value.get('cudagraph_capture_sizes')}; pass one")
            value["cudagraph_capture_sizes"] = sizes_given
        if value is not None:
            _require(isinstance(value, dict), "--compilation-config must be a JSON object / dict or a level 0-3, "
                                              f"got {type(value).__name__}")
            unknown = sorted(set(value) - set(COMPILATION_KEYS) - set(COMPILATION_KEYS_IGNORED))
            _require(not unknown, f"--compilation-config has unknown key(s) {', '.join(unknown)}; moeserve reads "
                     f"{', '.join(COMPILATION_KEYS)} (and accepts vLLM's {', '.join(COMPILATION_KEYS_IGNORED)}, "
                     "which do not apply to its decode graphs)")
            for key in ("mode", "level"):
                if key in value:
                    level = value[key]
                    _require(isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 3,
                             f"--compilation-config {key} must be 0-3 (0: eager), got {level!r}")
                    eager = eager or level == 0
            if value.get("cudagraph_mode") in ("NONE", "none") and not _CPU_GRAPHS_ARE_COMPILED:
                eager = True
            if "cudagraph_capture_sizes" in value:
                got = value["cudagraph_capture_sizes"]
                _require(isinstance(got, list) and got and all(
                    isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in got),
                    "--compilation-config cudagraph_capture_sizes must be a non-empty list of positive integers, "
                    f"got {got!r}")
                sizes = tuple(sorted(set(got)))
            if "max_cudagraph_capture_size" in value:
                cap = value["max_cudagraph_capture_size"]
                _require(isinstance(cap, int) and not isinstance(cap, bool) and cap > 0,
                         f"--compilation-config max_cudagraph_capture_size must be a positive integer, got {cap!r}")
                sizes = tuple(n for n in (sizes or decode_graph_sizes_up_to(cap)) if n <= cap) or (cap,)
        return {"enforce_eager": eager, "decode_graph_sizes": sizes}

    def _kv_cache_memory(self) -> int | None:
        _require(self.kv_cache_memory is None or self.kv_cache_memory_bytes is None
                 or self.kv_cache_memory == self.kv_cache_memory_bytes,
                 "--kv-cache-memory and --kv-cache-memory-bytes are the same option; pass one")
        return self.kv_cache_memory if self.kv_cache_memory is not None else self.kv_cache_memory_bytes

    def _cache_dtype(self) -> str:
        """--kv-cache-dtype names the model dtype (the KV cache is stored in it) or auto."""
        want = self.kv_cache_dtype
        _require(want in ("auto", self.dtype) or self.dtype == "auto" or want.startswith("fp8"),
                 f"--kv-cache-dtype {want} differs from --dtype {self.dtype}: the KV cache is kept in the model "
                 "dtype; drop --kv-cache-dtype or pass the same dtype to both")
        return want

    def _parallel_fields(self) -> dict:
        """ParallelConfig's fields, with vLLM's --all2all-backend and --eplb-config translated."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelConfig)
                  if hasattr(self, f.name)}  # stall_timeout comes from the server's --engine-stall-timeout
        if self.all2all_backend is not None:
            b = self.all2all_backend
            _require(b in ALL2ALL_BACKENDS, f"--all2all-backend must be one of {', '.join(ALL2ALL_BACKENDS)}, "
                                            f"got {b!r}")
            mapped = ALL2ALL_BACKENDS[b]
            _require(self.moe_comm in ("auto", mapped),
                     f"--all2all-backend {b} means --moe-comm {mapped}, but --moe-comm {self.moe_comm} is given")
            if self.enable_expert_parallel or mapped == "allgather":
                fields["moe_comm"] = mapped  # without EP, experts are TP-sharded: allgather is the one way
        if self.eplb_config is not None:
            fields.update(_eplb_fields(self.eplb_config, self))
        return fields

    def _check_slo_layout(self) -> None:
        # Every TP rank runs its own scheduler and they must agree on each batch; admission decides from
        # each rank's own clock and measured steps, so it would split them.
        _require(self.tensor_parallel_size == 1 or (self.slo_ttft_ms is None and self.slo_tpot_ms is None),
                 "--slo-ttft-ms / --slo-tpot-ms work with --tensor-parallel-size 1 (and any "
                 "--data-parallel-size); drop them or use data parallelism")

    def speculative(self) -> "SpeculativeConfig | None":
        """--speculative-config with vLLM's keys understood (_vllm_speculative)."""
        return SpeculativeConfig.from_value(_vllm_speculative(self.speculative_config, self))

    def _kv_transfer(self) -> "KVTransferConfig | None":
        kvt = KVTransferConfig.from_value(_vllm_kv_transfer(self.kv_transfer_config))
        _require(kvt is None or nixl_installed(), "--kv-transfer-config: prefill/decode disaggregation moves KV "
                 "over NIXL, which is not installed: pip install 'moeserve[pd]' (nixl-cu12; nixl-cu13 for CUDA 13)")
        # Each DP rank's own agent serves its KV; TP peers would each need theirs, and every node its address.
        _require(kvt is None or (self.tensor_parallel_size == self.nnodes == 1),
                 "--kv-transfer-config works with --data-parallel-size N but not yet with --tensor-parallel-size "
                 "> 1 or --nnodes > 1; scale out with more instances behind `moeserve proxy` instead")
        _require(kvt is None or kvt.kv_port is None or kvt.kv_port + self.data_parallel_size - 1 <= 65535,
                 f"--kv-transfer-config kv_port: DP rank r listens on kv_port + r; {self.data_parallel_size} "
                 "ranks do not fit below 65536")
        if kvt is not None:
            from moeserve.disagg.trust import TrustError, resolve_secret
            try:
                kvt = dataclasses.replace(kvt, kv_secret=resolve_secret(kvt.kv_secret, "--kv-transfer-config"))
            except TrustError as e:
                raise ConfigError(str(e)) from None
        return kvt
