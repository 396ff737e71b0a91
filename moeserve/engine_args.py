"""EngineArgs: every field is both a CLI flag (`--max-num-seqs`, vLLM's spelling) and an
`LLM(max_num_seqs=...)` keyword, as in vLLM; create_config() validates them into the frozen EngineConfig
(config.py). Also the flag value syntax (sizes, 32k lengths) and the vLLM flags translated to ours."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import numbers
import re
import typing
from dataclasses import dataclass

from moeserve.config import (ALL2ALL_BACKENDS, CacheConfig, ConfigError, EngineConfig, KVTransferConfig,
                             ModelConfig, ParallelConfig, QuantConfig, SchedulerConfig, SpeculativeConfig,
                             _parse_json_dict, _require, decode_graph_sizes_up_to)


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


def _parse_size(text: str) -> int:
    """Bytes, optionally with a K/M/G suffix (powers of 1024): '512M', '2G', '1073741824'."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b") if text.strip().lower()[-1:] in "bB" else text.strip().lower()
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M or 2G, got {text!r}") from None


SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",), "enable_expert_parallel": ("-ep",),
               "quantization": ("-q",), "speculative_config": ("-sc",),
               "compilation_config": ("-O", "-cc"), "nnodes": ("-n",), "node_rank": ("-r",),
               "gpu_memory_utilization": ("--device-memory-utilization",),
               "data_parallel_size_local": ("-dpl",), "data_parallel_start_rank": ("-dpr",),
               "data_parallel_address": ("-dpa",), "data_parallel_rpc_port": ("-dpp",),
               "data_parallel_backend": ("-dpb",),
               "moe_node_size": ("--ranks-per-node",)}  # vLLM's short forms; --ranks-per-node is moeserve's


def human_readable_int(text: str) -> int:
    """vLLM's integer syntax: 1000, 1k / 2m (powers of 10, decimals allowed: 25.6k) or 1K / 2M (powers of 2)."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", t)
    if m is None:
        try:
            return int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 32K, got {text!r}") from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: no decimals with a binary suffix; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) << (10 * ("KMGT".index(suffix) + 1))


def _parse_len(text: str) -> int | None:
    """--max-model-len: an integer as above, or auto / -1 for the model's own maximum."""
    return None if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


# One line per engine flag for --help (the formatter appends each default).
ENGINE_HELP = {
    "tokenizer": "tokenizer folder, if not the model's",
    "dtype": "auto|float32|bfloat16|float16 (vLLM's half, float too) for weights and KV cache (auto: the "
             "checkpoint's, BF16 for FP8)",
    "seed": "seed of the sampler for requests without their own seed",
    "max_model_len": "context length, >= 2 (None: the model's max_position_embeddings)",
    "max_num_seqs": "running requests per step",
    "max_num_batched_tokens": "tokens per step; longer prompts are prefilled in chunks",
    "enable_chunked_prefill": "split prompts longer than the token budget over several steps",
    "enable_prefix_caching": "reuse the KV cache of prompt prefixes computed before (automatic prefix caching)",
    "slo_ttft_ms": "default time-to-first-token target: admission turns away (503) requests that cannot meet "
                   "it (requests may set slo_ttft_ms themselves)",
    "slo_tpot_ms": "default time-per-output-token target: requests are admitted only while the running batch "
                   "keeps it (requests may set slo_tpot_ms themselves)",
    "mla_decode": "standard|amla|amla-triton: MLA decode attention; amla rescales the online softmax by an integer "
                  "add on the output's exponent bits (layers/attention/amla.py)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV pool size in blocks (None: every sequence at full length, at most 2 GiB)",
    "kv_cache_memory": "KV pool size in bytes, e.g. 512M or 2G (instead of --num-kv-blocks)",
    "data_parallel_size": "attention data-parallel ranks (processes)",
    "tensor_parallel_size": "attention tensor-parallel ranks inside each DP rank",
    "enable_expert_parallel": "spread routed experts over all ranks instead of TP-sharding each one",
    "quantization": "a8w8: INT8 weights and activations; fp8: block-FP8 weights (None: the checkpoint's own)",
    "speculative_config": 'MTP drafts as JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\'',
    "kv_transfer_config": 'prefill/decode disaggregation over NIXL as JSON, e.g. \'{"kv_connector": "nixl"}\'',
    "moe_comm": "auto|alltoall|allgather: how MoE layers move tokens between EP ranks",
    "moe_comm_dtype": "bfloat16|int8 payload of the MoE dispatch",
    "moe_comm_hierarchy": "flat|two-stage: with --moe-comm allgather over several nodes, gather across nodes "
                          "(one rank per node per group) then inside each node, and reduce-scatter the mirror way: "
                          "inter-node links carry each byte once",
    "moe_node_size": "EP ranks per node for the MoE collectives (default: D x T / --nnodes); on one machine it "
                     "groups the ranks into simulated nodes",
    "moe_pipeline_chunks": "K > 1: each MoE layer's dispatch -> experts -> combine over K chunks of tokens, later "
                           "chunks' transfers in flight while a chunk computes",
    "flashcomm": "off|on|int8: with TP, ReduceScatter + (INT8) AllGather instead of AllReduce",
    "attention_tp_dp_switch": "with TP: q_a / kv_a projections on each rank's token shard, one all-gather of the "
                              "projected query and latent, head-parallel attention, reduce-scatter back (turns "
                              "on --flashcomm's token sharding)",
    "num_redundant_experts": "extra routed-expert replicas (EPLB)",
    "shared_expert_ranks": "N of the EP ranks hold only the shared experts (every token's shared-expert row is "
                           "dispatched to them); the routed experts spread over the others",
    "expert_placement": "JSON file mapping logical experts to physical slots per layer (moeserve eplb -o)",
    "expert_load_stats": "record routed tokens per expert and MoE layer to this JSON file (PATH.rank<r> per rank)",
    "enable_eplb": "online EPLB: re-place (and replicate) experts from recent loads while serving",
    "enable_dbo": "dual-batch overlap: split every step into two micro-batches so that one's MoE "
                  "dispatch/combine transfers run under the other's attention and experts (with EP over DP ranks)",
    "eplb_step_interval": "steps between online EPLB rebalances",
    "nnodes": "nodes of a multi-node run",
    "node_rank": "this node's index",
    "master_addr": "address of node 0 (torch.distributed rendezvous)",
    "master_port": "rendezvous port (None: a free port on one node)",
    "distributed_backend": "auto|gloo|nccl (auto: NCCL for CUDA, gloo otherwise)",
    "distributed_timeout": "seconds a collective may wait before the engine reports a dead rank",
    "kv_cache_dtype": "auto|bfloat16|float16|float32|fp8: KV-cache storage, the model dtype or FP8 e4m3 "
                      "(half the bytes of BF16; attention upcasts what it reads)",
    "kv_cache_memory_bytes": "vLLM's name for --kv-cache-memory (bytes, e.g. 2G)",
    "gpu_memory_utilization": "share of the device's memory (host RAM on CPU) for weights + KV cache; the KV "
                              "pool gets what the weights leave (None: --kv-cache-memory's default sizing)",
    "load_format": "auto|safetensors|dummy (dummy: random weights of the checkpoint's shapes, for benchmarks)",
    "enforce_eager": "run the model eagerly: no compiled or captured decode graphs",
    "compilation_config": 'vLLM\'s compilation config as JSON or a level: \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\' '
                          "picks the decode graph sizes, mode/level 0 (or `-O 0`) runs eagerly",
    "skip_tokenizer_init": "load no tokenizer: prompts are token ids and outputs carry token ids, no text",
    "max_logprobs": "the most logprobs / prompt_logprobs one request may ask for (0..20)",
    "logprobs_mode": "raw_logprobs: log-softmax of the model's logits before any processor",
    "scheduling_policy": "fcfs|priority (priority: lower request `priority` first, ties by arrival)",
    "eplb_config": 'EPLB as JSON (vLLM\'s), e.g. \'{"step_interval": 3000, "num_redundant_experts": 0}\'',
    "all2all_backend": "vLLM's MoE all2all backend: allgather_reducescatter/naive -> --moe-comm allgather, "
                       "deepep_*/pplx/... -> --moe-comm alltoall",
    "override_generation_config": 'JSON of sampling defaults over generation_config, e.g. \'{"temperature": 0.5}\'',
    "disable_log_stats": "no periodic stats line in the log",
    "generation_config": "auto|vllm|FOLDER: sampling defaults (temperature, top_p, top_k, min_p, "
                         "repetition_penalty, max_new_tokens) from the model's (or FOLDER's) generation_config.json "
                         "for requests that leave them unset; vllm: none",
    # vLLM recipe flags (issue 33): accepted so a recipe runs unchanged; docs/from-vllm.md says what each does
    "trust_remote_code": "accepted for vLLM recipes; moeserve implements DeepSeek V2/V3 itself and never runs "
                         "code from a checkpoint, with or without this flag",
    "async_scheduling": "accepted; no effect here (moeserve's engine schedules each step after the last one's "
                        "outputs; an INFO line says so)",
    "attention_backend": "accepted; no effect here (MLA attention is moeserve's own, see --mla-decode; an INFO "
                         "line says so)",
    "tokenizer_mode": "auto|hf|slow|deepseek_v32: accepted; moeserve always loads the checkpoint's own tokenizer "
                      "(transformers AutoTokenizer); other modes are refused",
    "revision": "the branch, tag or commit of a Hugging Face model id (no effect on a local folder)",
    "download_dir": "the Hugging Face cache folder a model id is looked up in and downloaded to (default: "
                    "HF_HUB_CACHE, else ~/.cache/huggingface/hub)",
    "hf_overrides": "JSON over the checkpoint's config.json: only {} (nothing to override) is accepted for now; "
                    "other values are refused",
    "cudagraph_capture_sizes": "decode batch sizes to compile graphs for, e.g. 1 2 4 8 (the same as "
                               "--compilation-config '{\"cudagraph_capture_sizes\": [...]}')",
    # vLLM flags mapped onto moeserve's (vllm_flag_table.py)
    "data_parallel_size_local": "vLLM's multi-node DP: DP ranks on this node -> --nnodes = --data-parallel-size / "
                                "this",
    "data_parallel_start_rank": "vLLM's multi-node DP: this node's first DP rank -> --node-rank = this / "
                                "--data-parallel-size-local",
    "data_parallel_address": "vLLM's multi-node DP: node 0's address -> --master-addr",
    "data_parallel_rpc_port": "vLLM's multi-node DP: rendezvous port -> --master-port (vLLM's default 29550 when "
                              "more than one node)",
    "data_parallel_backend": "mp (moeserve spawns its rank processes); ray is refused",
    "distributed_timeout_seconds": "vLLM's name for --distributed-timeout",
    "cpu_distributed_timeout_seconds": "vLLM's name for --distributed-timeout (gloo groups)",
    "max_cudagraph_capture_size": "the largest decode batch with a compiled graph (--compilation-config "
                                  "max_cudagraph_capture_size)",
    "optimization_level": "vLLM's -O level: 0 runs eagerly, 1-3 compile the decode step (--compilation-config mode)",
    "num_gpu_blocks_override": "vLLM's name for --num-kv-blocks",
    "spec_method": "vLLM's shorthand for --speculative-config method (mtp / deepseek_mtp)",
    "spec_tokens": "vLLM's shorthand for --speculative-config num_speculative_tokens",
}

# vLLM's --dtype spellings -> moeserve's
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
TOKENIZER_MODES = ("auto", "hf", "slow", "deepseek_v32")


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
            if given and name not in _LOGGED_NOTES:
                _LOGGED_NOTES.add(name)
                logging.getLogger("moeserve").info("--%s has no effect here: %s", name.replace("_", "-"), why)

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




# vLLM's CompilationConfig keys: the ones moeserve's decode graphs read, and the ones it accepts so that a
# vLLM recipe runs unchanged although they name vLLM internals (its custom ops, fusion passes, splitting ops).
COMPILATION_KEYS = ("mode", "level", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")
COMPILATION_KEYS_IGNORED = ("backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
                            "inductor_compile_config", "inductor_passes", "pass_config", "full_cuda_graph",
                            "use_cudagraph", "cudagraph_num_of_warmups", "debug_dump_path", "cache_dir",
                            "compile_cache_save_format", "use_inductor_graph_partition", "dynamic_shapes_config")
_LOGGED_NOTES: set[str] = set()  # recipe flags already logged as having no effect (once per process)
# On CPU the decode graphs are inductor graphs, not captured CUDA graphs: cudagraph_mode NONE keeps them.
_CPU_GRAPHS_ARE_COMPILED = True


VLLM_DP_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the meta package, or a CUDA-variant wheel on its own


def nixl_installed() -> bool:
    """Whether NIXL's Python package is importable (looked up, not imported: that waits for PD's agent)."""
    import importlib.util

    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (import blocked)
            continue
    return False


def _note_once(key: str, message: str, *args) -> None:
    """An INFO line for an accepted vLLM value that changes nothing here, once per process."""
    if key not in _LOGGED_NOTES:
        _LOGGED_NOTES.add(key)
        logging.getLogger("moeserve").info(message, *args)


# vLLM's SpeculativeConfig keys that change nothing for MTP drafts here -> why
SPEC_KEYS_NO_EFFECT = {
    "enforce_eager": "the MTP passes use the target's decode graphs (or run eagerly with it)",
    "disable_padded_drafter_batch": "moeserve pads draft batches to the target's decode buckets",
    "disable_eagle_block_drop": "an EAGLE option",
    "use_local_argmax_reduction": "drafts are argmaxed over the whole vocabulary on each rank",
    "index_share_for_mtp_iteration": "a sparse-attention indexer option (DeepSeek V3.2)",
    "moe_backend": "the MTP layer's experts use the target's MoE path",
    "attention_backend": "MLA attention is moeserve's own",
    "max_model_len": "drafts stop at the target's --max-model-len",
    "revision": "the MTP layers come from the model's own checkpoint",
    "code_revision": "no code is run from a checkpoint",
}
# vLLM's keys with the values moeserve's MTP drafting matches
SPEC_KEYS_FIXED = {"rejection_sample_method": ("standard",), "draft_sample_method": ("greedy",),
                   "parallel_drafting": (False,)}


def _vllm_speculative(value, args: "EngineArgs"):
    """vLLM's --speculative-config keys onto moeserve's (method, num_speculative_tokens): a draft `model` that
    is the target itself, `draft_tensor_parallel_size` / `tensor_parallel_size` of 1 or the target's TP (the
    MTP layers run on the target's ranks), the target's `quantization`; the keys of SPEC_KEYS_NO_EFFECT are
    logged as having no effect. Other values are refused naming the key."""
    if value is None or not isinstance(value, (dict, str)):
        return value
    if isinstance(value, str):
        value = _parse_json_dict(value, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}')
    value = dict(value)
    model = value.pop("model", None)
    _require(model is None or _same_model(model, args),
             f"--speculative-config model {model!r}: moeserve drafts with the checkpoint's own MTP layers, not a "
             "separate draft model; drop \"model\" (or give the target model itself)")
    for key in ("draft_tensor_parallel_size", "tensor_parallel_size"):
        if key in value:
            tp = value.pop(key)
            _require(tp in (None, 1, args.tensor_parallel_size), f"--speculative-config {key} {tp!r}: the MTP "
                     f"layers run on the target's ranks (--tensor-parallel-size {args.tensor_parallel_size}); "
                     f"give 1 or {args.tensor_parallel_size}, or drop it")
            if tp is not None:
                _note_once(f"spec:{key}", "--speculative-config %s %s: the MTP layers run on the target's ranks "
                           "(TP %s)", key, tp, args.tensor_parallel_size)
    if "quantization" in value:
        q = value.pop("quantization")
        _require(q in (None, args.quantization), f"--speculative-config quantization {q!r}: the MTP layers are "
                 f"quantized as the target is (--quantization {args.quantization}); drop it")
    if "kv_cache_dtype" in value:
        kv = value.pop("kv_cache_dtype")
        _require(kv in (None, "auto", args.kv_cache_dtype), f"--speculative-config kv_cache_dtype {kv!r}: the "
                 f"MTP layer's KV cache is stored as the target's (--kv-cache-dtype {args.kv_cache_dtype})")
    for key, allowed in SPEC_KEYS_FIXED.items():
        if key in value:
            got = value.pop(key)
            _require(got in allowed, f"--speculative-config {key} {got!r}: moeserve's MTP uses "
                     f"{' / '.join(map(str, allowed))}")
    for key, why in SPEC_KEYS_NO_EFFECT.items():
        if key in value:
            got = value.pop(key)
            if got not in (None, False):
                _note_once(f"spec:{key}", "--speculative-config %s has no effect here: %s", key, why)
    return value


def _same_model(model: str, args: "EngineArgs") -> bool:
    """The speculative-config `model` names the target (as given, or resolving to the same folder)."""
    import os

    if args.model is None:
        return False
    if model == args.model:
        return True
    from moeserve.hf_model import resolve_model
    try:
        path = resolve_model(model, args.revision, args.download_dir)
    except FileNotFoundError:
        return False
    return os.path.realpath(path) == os.path.realpath(args.model)


# vLLM's connector names -> moeserve's; its KVTransferConfig keys without effect here -> why
KV_CONNECTOR_NAMES = {"NixlConnector": "nixl", "nixl": "nixl"}
KV_KEYS_NO_EFFECT = {
    "kv_buffer_device": "NIXL reads and writes the KV pool in place (host memory here)",
    "kv_buffer_size": "NIXL reads and writes the KV pool in place",
    "kv_connector_extra_config": "moeserve's NIXL agent uses its UCX backend",
    "enable_permute_local_kv": "the KV layout is the same on both sides",
}


def _vllm_kv_transfer(value):
    """vLLM's --kv-transfer-config spellings: kv_connector NixlConnector, kv_load_failure_policy fail (what
    moeserve does: the request fails), the keys of KV_KEYS_NO_EFFECT logged; other connectors refused."""
    if value is None or not isinstance(value, (dict, str)):
        return value
    if isinstance(value, str):
        value = _parse_json_dict(value, "--kv-transfer-config", '{"kv_connector": "NixlConnector", '
                                                                '"kv_role": "kv_both"}')
    value = dict(value)
    if "kv_connector" in value:
        name = value["kv_connector"]
        _require(name in KV_CONNECTOR_NAMES, f"--kv-transfer-config kv_connector {name!r}: moeserve moves KV "
                 "over NIXL only; use \"NixlConnector\" (or \"nixl\")")
        value["kv_connector"] = KV_CONNECTOR_NAMES[name]
    _require(value.pop("kv_connector_module_path", None) is None, "--kv-transfer-config kv_connector_module_path: "
             "connectors are not loaded from modules (NIXL is built in); drop it")
    policy = value.pop("kv_load_failure_policy", "fail")
    _require(policy == "fail", f"--kv-transfer-config kv_load_failure_policy {policy!r}: a failed KV pull fails "
             "its request here (vLLM's \"fail\"); recompute is not supported")
    for key, why in KV_KEYS_NO_EFFECT.items():
        if key in value:
            got = value.pop(key)
            if got not in (None, False, {}):
                _note_once(f"kv:{key}", "--kv-transfer-config %s has no effect here: %s", key, why)
    return value

EPLB_KEYS = ("window_size", "step_interval", "num_redundant_experts", "log_balancedness", "use_async", "policy",
             "log_balancedness_interval", "communicator", "enable_migration_batching")
# vLLM's EPLB keys accepted without effect -> why
EPLB_KEYS_NO_EFFECT = {
    "window_size": "moeserve balances on the loads of every step since the last rebalance (the window is "
                   "step_interval)",
    "log_balancedness": "no balancedness line is logged; --expert-load-stats records per-expert loads",
    "log_balancedness_interval": "no balancedness line is logged",
    "use_async": "a rebalance runs between two steps",
    "communicator": "experts move over the ranks' process group",
    "enable_migration_batching": "a rebalance moves every expert at once",
}


def _eplb_fields(value: "dict | str", args: "EngineArgs") -> dict:
    """vLLM's --eplb-config -> --eplb-step-interval / --num-redundant-experts (explicit flags must agree)."""
    if isinstance(value, str):
        value = _parse_json_dict(value, "--eplb-config", '{"step_interval": 3000, "num_redundant_experts": 32}')
    _require(isinstance(value, dict), f"--eplb-config must be a JSON object / dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(EPLB_KEYS))
    _require(not unknown, f"--eplb-config has unknown key(s) {', '.join(unknown)}; known: {', '.join(EPLB_KEYS)}")
    interval = value.get("step_interval", args.eplb_step_interval)
    window = value.get("window_size")
    _require(window is None or (isinstance(window, int) and not isinstance(window, bool) and window > 0),
             f"--eplb-config window_size must be a positive integer, got {window!r}")
    _require(value.get("policy", "default") == "default", "--eplb-config policy: only \"default\" is supported")
    for key, why in EPLB_KEYS_NO_EFFECT.items():
        if value.get(key) not in (None, False) and not (key == "window_size" and window == interval) \
                and not (key == "use_async" and value[key] is True):
            _note_once(f"eplb:{key}", "--eplb-config %s has no effect here: %s", key, why)
    out = {}
    for key, field_name, default in (("step_interval", "eplb_step_interval", 3000),
                                     ("num_redundant_experts", "num_redundant_experts", 0)):
        if key in value:
            given = getattr(args, field_name)
            _require(given in (default, value[key]), f"--eplb-config {key} {value[key]} disagrees with "
                     f"--{field_name.replace('_', '-')} {given}; pass one")
            _require(isinstance(value[key], int) and not isinstance(value[key], bool),
                     f"--eplb-config {key} must be an integer, got {value[key]!r}")
            out[field_name] = value[key]
    return out
