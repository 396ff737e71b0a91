"""Engine configuration: frozen dataclasses, one per concern, validated on construction.

Every field of EngineArgs is both a CLI flag (`--max-num-seqs`) and an `LLM(max_num_seqs=...)` keyword,
as in vLLM. EngineArgs.create_config() turns it into the frozen EngineConfig the engine runs with; this module is plain
data and imports no models/, layers/ or engine/ code (engine/resolve.py does the checkpoint lookups).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import re
from dataclasses import dataclass, field
import typing

DTYPES = ("auto", "float32", "bfloat16", "float16")
MLA_DECODE_IMPLS = ("standard", "amla", "amla-triton")  # --mla-decode: absorbed decode attention
# the KV cache is held in the model dtype, or in FP8 e4m3 (vLLM's "fp8" / "fp8_e4m3"; layers/attention/mla.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
LOGPROBS_MODES = ("raw_logprobs",)  # log-softmax of the model's logits before any processor (vLLM's default)
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --all2all-backend -> moeserve's --moe-comm
ALL2ALL_BACKENDS = {"allgather_reducescatter": "allgather", "naive": "allgather", "pplx": "alltoall",
                    "deepep_high_throughput": "alltoall", "deepep_low_latency": "alltoall", "deepep_v2": "alltoall",
                    "mori_high_throughput": "alltoall", "mori_low_latency": "alltoall", "nixl_ep": "alltoall",
                    "flashinfer_all2allv": "alltoall", "flashinfer_nvlink_two_sided": "alltoall",
                    "flashinfer_nvlink_one_sided": "alltoall"}
QUANTIZATION_METHODS = ("a8w8", "fp8")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; overrides kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = default (see kv_cache.py)
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (vLLM's default too)
    cache_dtype: str = "auto"  # --kv-cache-dtype: the model dtype (auto) or that dtype named, or fp8

    @property
    def fp8_kv(self) -> bool:
        return self.cache_dtype in ("fp8", "fp8_e4m3")
    gpu_memory_utilization: float | None = None  # share of device memory for weights + KV (engine/kv_memory.py)

    def __post_init__(self) -> None:
        _require(self.cache_dtype in KV_CACHE_DTYPES,
                 f"--kv-cache-dtype {self.cache_dtype}: " + ("FP8 KV-cache storage is e4m3 only; use fp8 (or "
                 "fp8_e4m3)" if self.cache_dtype.startswith("fp8") else
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}"))
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.block_size >= 1, f"--block-size must be >= 1, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"--kv-cache-memory must be a positive number of bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    slo_ttft_ms: float | None = None  # default targets of SLO-aware admission (engine/slo.py)
    slo_tpot_ms: float | None = None
    policy: str = "fcfs"  # --scheduling-policy: fcfs, or priority (lower request priority value first)

    def __post_init__(self) -> None:
        from moeserve.engine.slo import check_slo_ms
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            try:
                check_slo_ms(getattr(self, name), "--" + name.replace("_", "-"))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        _require(self.policy in SCHEDULING_POLICIES,
                 f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        _require(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 2, f"--max-model-len must be >= 2, got {self.max_model_len}")
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill --max-num-batched-tokens must be >= --max-model-len "
                 f"({self.max_num_batched_tokens} < {self.max_model_len})")


MOE_COMMS = ("auto", "alltoall", "allgather")
MOE_COMM_DTYPES = ("bfloat16", "int8")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """The rank grid (D data-parallel ranks x T tensor-parallel ranks) and how MoE layers talk.

    Global rank r = dp_rank * T + tp_rank. Without expert parallelism the routed experts are TP-sharded
    over all D x T ranks (each holds a slice of every expert's intermediate dim); with it, each rank holds
    whole experts (physical slots, see layers/moe/placement.py).
    """

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    moe_comm: str = "auto"  # auto: alltoall with EP, allgather/reduce-scatter without
    moe_comm_dtype: str = "bfloat16"  # dispatch payload: activations as they are, or int8 + per-token scales
    flashcomm: str = "off"  # attention TP: "on" = ReduceScatter + AllGather, "int8" = INT8 AllGather
    num_redundant_experts: int = 0
    expert_placement: str | None = None  # JSON file with the logical->physical map
    expert_load_stats: str | None = None  # record per-expert routed pairs to this JSON (layers/moe/load_stats.py)
    enable_eplb: bool = False  # re-place experts while serving (layers/moe/eplb_online.py)
    eplb_step_interval: int = 3000  # lockstep steps between rebalances (vLLM's default)
    enable_dbo: bool = False  # dual-batch overlap: two micro-batches per step, one's MoE comm under the other's compute
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    distributed_backend: str = "auto"
    distributed_timeout: float = 60.0  # seconds before a stuck collective / dead rank is an error

    def __post_init__(self) -> None:
        _require(self.data_parallel_size >= 1, "--data-parallel-size must be >= 1")
        _require(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")
        _require(self.moe_comm in MOE_COMMS, f"--moe-comm must be one of {', '.join(MOE_COMMS)}, got {self.moe_comm!r}")
        _require(self.moe_comm_dtype in MOE_COMM_DTYPES, f"--moe-comm-dtype must be one of "
                 f"{', '.join(MOE_COMM_DTYPES)}, got {self.moe_comm_dtype!r}")
        _require(self.flashcomm in ("off", "on", "int8"),
                 f"--flashcomm must be one of off, on, int8, got {self.flashcomm!r}")
        _require(self.flashcomm == "off" or self.tensor_parallel_size > 1,
                 f"--flashcomm {self.flashcomm} shards attention's tensor parallelism: it needs "
                 "--tensor-parallel-size > 1")
        _require(self.distributed_backend in BACKENDS,
                 f"--distributed-backend must be one of {', '.join(BACKENDS)}, got {self.distributed_backend!r}")
        _require(self.num_redundant_experts >= 0, "--num-redundant-experts must be >= 0")
        _require(self.moe_comm != "alltoall" or self.enable_expert_parallel or self.world_size == 1,
                 "--moe-comm alltoall sends tokens to the ranks holding whole experts: add "
                 "--enable-expert-parallel (without it experts are TP-sharded and use allgather)")
        _require(self.num_redundant_experts == 0 or self.enable_expert_parallel or self.world_size == 1,
                 "--num-redundant-experts needs --enable-expert-parallel (replicas are whole experts)")
        _require(not self.enable_eplb or (self.enable_expert_parallel and self.world_size > 1),
                 "--enable-eplb moves whole experts between EP ranks: it needs --enable-expert-parallel and "
                 "--data-parallel-size x --tensor-parallel-size > 1")
        _require(not self.enable_dbo or (self.tensor_parallel_size == 1 and self.flashcomm == "off"),
                 "--enable-dbo overlaps data-parallel ranks' MoE communication; it does not yet combine with "
                 "--tensor-parallel-size > 1 or --flashcomm")
        _require(self.eplb_step_interval >= 1, f"--eplb-step-interval must be >= 1, got {self.eplb_step_interval}")
        _require(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
                 f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        _require(self.world_size % self.nnodes == 0,
                 f"--data-parallel-size x --tensor-parallel-size = {self.world_size} ranks do not divide "
                 f"over --nnodes {self.nnodes}")
        _require(self.nnodes == 1 or self.master_port is not None,
                 "multi-node runs need --master-port (and --master-addr of node 0)")
        # Multi-node: the front end's ZMQ socket takes the next port, so that one must exist too.
        top = 65535 if self.nnodes == 1 else 65534
        _require(self.master_port is None or 1 <= self.master_port <= top,
                 f"--master-port must be in 1..{top}"
                 + (" (the front end listens on --master-port + 1)" if self.nnodes > 1 else "")
                 + f", got {self.master_port}")
        _require(self.distributed_timeout > 0, "--distributed-timeout must be > 0 seconds")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def resolved_moe_comm(self) -> str:
        if self.moe_comm != "auto":
            return self.moe_comm
        return "alltoall" if self.enable_expert_parallel else "allgather"


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    tokenizer: str | None = None
    seed: int = 0
    mla_decode: str = "standard"  # MLA_DECODE_IMPLS (layers/attention/amla.py)
    load_format: str = "auto"  # dummy: random weights of the checkpoint's shapes, nothing read
    enforce_eager: bool = False  # run the forward eagerly (no compiled / captured decode graphs)
    skip_tokenizer_init: bool = False  # token ids in and out; no tokenizer is loaded
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.mla_decode in MLA_DECODE_IMPLS,
                 f"--mla-decode must be one of {', '.join(MLA_DECODE_IMPLS)}, got {self.mla_decode!r}")
        _require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.load_format in LOAD_FORMATS,
                 f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _require(0 <= self.max_logprobs <= 20, f"--max-logprobs must be in 0..20 (moeserve returns at most 20 "
                 f"alternatives per token), got {self.max_logprobs}")
        _require(self.logprobs_mode in LOGPROBS_MODES,
                 f"--logprobs-mode {self.logprobs_mode!r} is not supported: moeserve returns raw_logprobs "
                 "(log-softmax of the model's logits before penalties, temperature and top-k/p)")


SPEC_METHODS = {"mtp": "mtp", "deepseek_mtp": "mtp"}  # vLLM's names -> ours
MAX_SPEC_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` (vLLM's shape)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        _require(self.method in SPEC_METHODS,
                 f"--speculative-config method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_SPEC_TOKENS,
                 f"--speculative-config num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, "
                 f"got {k!r}")
        object.__setattr__(self, "method", SPEC_METHODS[self.method])

    @classmethod
    def from_value(cls, value: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A dict (LLM keyword), a JSON string (the flag) or None (no speculative decoding)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = _json_config_keys(cls, value, "--speculative-config",
                                  '{"method": "mtp", "num_speculative_tokens": 1}')
        _require("method" in value, '--speculative-config needs a "method" (e.g. {"method": "mtp"})')
        return cls(**value)


def _json_config_keys(cls, value: "dict | str", flag: str, example: str) -> dict:
    """A JSON-object flag (or the LLM keyword's dict) whose keys are all fields of the config `cls`."""
    if isinstance(value, str):
        value = _parse_json_dict(value, flag, example)
    _require(isinstance(value, dict), f"{flag} must be a JSON object / dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    _require(not unknown, f"{flag} has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value


def _parse_json_dict(text: str, flag: str, example: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} must be a JSON object such as '{example}': {e}") from None
    _require(isinstance(value, dict), f"{flag} must be a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class QuantConfig:
    """Weight/activation quantization, resolved from --quantization and the checkpoint's quantization_config.

    method None = the model dtype everywhere. "a8w8": INT8 weights (per output channel) and activations (per
    token) in attention projections, dense MLPs and experts; embeddings, lm_head, router and norms stay in
    the model dtype, the KV cache too. "fp8": the same layers in block FP8 (e4m3 weights, a scale per 128x128
    block, layers/fp8.py). checkpoint_format says what the weights on disk are: "float" (BF16/FP32; quantized
    at load), "fp8" (DeepSeek block FP8: kept as is with --quantization fp8, dequantized for a8w8 or none) or
    "compressed-tensors" (INT8 + scales).
    """

    method: str | None = None
    checkpoint_format: str = "float"
    ignore: tuple[str, ...] = ()  # module names or "re:<regex>" kept high precision (the checkpoint's list)

    def __post_init__(self) -> None:
        _require(self.method is None or self.method in QUANTIZATION_METHODS,
                 f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.method!r}")
        _require(self.checkpoint_format in ("float", "fp8", "compressed-tensors"),
                 f"unknown checkpoint format {self.checkpoint_format!r}")
        _require(self.checkpoint_format == "float" or self.method is not None,
                 "an INT8 compressed-tensors checkpoint needs --quantization a8w8")
        _require(self.checkpoint_format != "compressed-tensors" or self.method == "a8w8",
                 f"an INT8 compressed-tensors checkpoint runs as --quantization a8w8, not {self.method}")


KV_CONNECTORS = ("nixl",)
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config '{"kv_connector": "nixl", "kv_role": "kv_both"}'` (vLLM's shape): prefill/decode
    disaggregation. A producer (prefill instance) keeps a finished prompt's KV blocks for a decode instance
    to pull; a consumer (decode instance) pulls them over NIXL and decodes from there (docs/disaggregation.md).

    kv_host / kv_port: where this engine's NIXL agent listens for peers (the port's default: a free one);
    engine_id: the agent's name (default: a fresh unique one); kv_hold_timeout: seconds a producer keeps
    blocks nobody pulled (the decode side or the proxy died) before it frees them.
    """

    kv_connector: str = "nixl"
    kv_role: str = "kv_both"
    kv_host: str = "127.0.0.1"
    kv_port: int | None = None
    engine_id: str | None = None
    kv_hold_timeout: float = 120.0
    # the deployment's shared secret (disagg/trust.py); None: $MOESERVE_KV_SECRET. Never printed.
    kv_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _require(self.kv_connector in KV_CONNECTORS, f"--kv-transfer-config kv_connector must be one of "
                                                     f"{', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        _require(self.kv_role in KV_ROLES,
                 f"--kv-transfer-config kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        _require(isinstance(self.kv_host, str) and bool(self.kv_host),
                 f"--kv-transfer-config kv_host must be a host name or address, got {self.kv_host!r}")
        _require(self.kv_port is None or (isinstance(self.kv_port, int) and not isinstance(self.kv_port, bool)
                                          and 1 <= self.kv_port <= 65535),
                 f"--kv-transfer-config kv_port must be a port number 1..65535, got {self.kv_port!r}")
        _require(self.engine_id is None or (isinstance(self.engine_id, str) and bool(self.engine_id)),
                 f"--kv-transfer-config engine_id must be a non-empty string, got {self.engine_id!r}")
        _require(isinstance(self.kv_hold_timeout, numbers.Real) and not isinstance(self.kv_hold_timeout, bool)
                 and self.kv_hold_timeout > 0,
                 f"--kv-transfer-config kv_hold_timeout must be a number of seconds > 0, got {self.kv_hold_timeout!r}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @classmethod
    def from_value(cls, value: "dict | str | KVTransferConfig | None") -> "KVTransferConfig | None":
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return cls(**_json_config_keys(cls, value, "--kv-transfer-config", '{"kv_connector": "nixl"}'))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    quant: QuantConfig = QuantConfig()
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None


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
               "quantization": ("-q",), "speculative_config": ("-sc",)}  # vLLM's


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
    "dtype": "auto|float32|bfloat16|float16 for weights and KV cache (auto: the checkpoint's, BF16 for FP8)",
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
    "flashcomm": "off|on|int8: with TP, ReduceScatter + (INT8) AllGather instead of AllReduce",
    "num_redundant_experts": "extra routed-expert replicas (EPLB)",
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
}


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
    flashcomm: str = "off"
    num_redundant_experts: int = 0
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
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    scheduling_policy: str = "fcfs"
    eplb_config: dict | str | None = None  # JSON: step_interval, num_redundant_experts (vLLM's EPLBConfig)
    all2all_backend: str | None = None  # vLLM's MoE backends -> --moe-comm
    override_generation_config: dict | str | None = None  # JSON merged over the generation_config defaults
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)

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
                              load_format=self.load_format, enforce_eager=self.enforce_eager,
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
            speculative=SpeculativeConfig.from_value(self.speculative_config),
            kv_transfer=self._kv_transfer(),
        )

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
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelConfig)}
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

    def _kv_transfer(self) -> "KVTransferConfig | None":
        kvt = KVTransferConfig.from_value(self.kv_transfer_config)
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


DEFAULT_MAX_REQUEST_BODY = 32 * 1024 * 1024


EPLB_KEYS = ("window_size", "step_interval", "num_redundant_experts", "log_balancedness", "use_async", "policy")


def _eplb_fields(value: "dict | str", args: "EngineArgs") -> dict:
    """vLLM's --eplb-config -> --eplb-step-interval / --num-redundant-experts (explicit flags must agree)."""
    if isinstance(value, str):
        value = _parse_json_dict(value, "--eplb-config", '{"step_interval": 3000, "num_redundant_experts": 32}')
    _require(isinstance(value, dict), f"--eplb-config must be a JSON object / dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(EPLB_KEYS))
    _require(not unknown, f"--eplb-config has unknown key(s) {', '.join(unknown)}; known: {', '.join(EPLB_KEYS)}")
    interval = value.get("step_interval", args.eplb_step_interval)
    _require("window_size" not in value or value["window_size"] == interval,
             "--eplb-config window_size: moeserve balances on the loads since the last rebalance, so the window is "
             f"step_interval ({interval}); drop window_size or set it equal")
    _require(not value.get("log_balancedness"), "--eplb-config log_balancedness is not supported; "
             "--expert-load-stats records per-expert loads instead")
    _require(value.get("policy", "default") == "default", "--eplb-config policy: only \"default\" is supported")
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


@dataclass(frozen=True)
class ServerConfig:
    """Options of `moeserve serve` that are not engine options (so they are not LLM keywords)."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    api_key: str | None = None
    max_waiting_requests: int | None = None
    chat_template: str | None = None  # a Jinja template (text); None = the tokenizer's or the default one
    log_level: str = "info"
    enable_auto_tool_choice: bool = False  # tool_choice "auto": needs tool_call_parser
    tool_call_parser: str | None = None  # entrypoints/tool_calls.py TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # entrypoints/reasoning.py REASONING_PARSERS
    max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY  # bytes; a larger body is a 413 before it is read
    shutdown_timeout: float = 20.0  # SIGTERM: seconds the requests in flight get to finish
    max_engine_restarts: int = 3  # engine-core deaths in a row that are restarted; then the deployment stops
    engine_restart_backoff: float = 1.0  # seconds before the first restart, doubled for each next one
    engine_stall_timeout: float = 5.0  # /health is 503 when the engine made no progress for this long
    served_model_aliases: tuple[str, ...] = ()  # --served-model-name's further names, also accepted
    max_num_queued_reqs: int | None = None  # in-flight (waiting + running) requests before a 503 (vLLM's)
    enable_log_requests: bool = False
    uvicorn_log_level: str = "warning"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 2 = CERT_REQUIRED (clients must present a certificate)
    root_path: str | None = None  # the path prefix a proxy serves this under (ASGI root_path)
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    def __post_init__(self) -> None:
        _require(self.max_request_body_size >= 1024,
                 f"--max-request-body-size must be >= 1024 bytes, got {self.max_request_body_size}")
        _require(self.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        _require(self.max_engine_restarts >= 0,
                 f"--max-engine-restarts must be >= 0 (0: none), got {self.max_engine_restarts}")
        _require(self.engine_restart_backoff >= 0,
                 f"--engine-restart-backoff must be >= 0 seconds, got {self.engine_restart_backoff}")
        _require(self.engine_stall_timeout > 0,
                 f"--engine-stall-timeout must be > 0 seconds, got {self.engine_stall_timeout}")
        _require(self.max_num_queued_reqs is None or self.max_num_queued_reqs >= 1,
                 f"--max-num-queued-reqs must be >= 1, got {self.max_num_queued_reqs}")
        _require(self.uvicorn_log_level in ("critical", "error", "warning", "info", "debug", "trace"),
                 f"--uvicorn-log-level must be critical, error, warning, info, debug or trace, "
                 f"got {self.uvicorn_log_level!r}")
        _require((self.ssl_keyfile is None) == (self.ssl_certfile is None),
                 "--ssl-keyfile and --ssl-certfile go together: pass both for HTTPS")
        _require(self.ssl_cert_reqs in (0, 1, 2), f"--ssl-cert-reqs must be 0, 1 or 2 (ssl.CERT_NONE/OPTIONAL/"
                 f"REQUIRED), got {self.ssl_cert_reqs}")
        _require(0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}")
        _require(self.api_server_count >= 1, f"--api-server-count must be >= 1, got {self.api_server_count}")
        _require(self.max_waiting_requests is None or self.max_waiting_requests >= 1,
                 f"--max-waiting-requests must be >= 1 (every request waits briefly before it runs), "
                 f"got {self.max_waiting_requests}")
        _require(self.api_key is None or bool(self.api_key), "--api-key must not be empty")
        from moeserve.entrypoints.reasoning import REASONING_PARSERS
        from moeserve.entrypoints.tool_calls import TOOL_CALL_PARSERS
        _require(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
                 f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        _require(self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
                 f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                 "--enable-auto-tool-choice needs --tool-call-parser (e.g. deepseek_v3)")
        _require(self.log_level.lower() in ("debug", "info", "warning", "error"),
                 f"--log-level must be debug, info, warning or error, got {self.log_level!r}")
