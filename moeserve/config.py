"""Engine configuration: frozen dataclasses, one per concern, validated on construction.

engine_args.py holds EngineArgs, the flags / LLM keywords that create_config() turns into the EngineConfig
below; this module is plain data and imports nothing of moeserve (engine/resolve.py does the checkpoint lookups,
the registries check their own names: e.g. --reasoning-parser's choices come from entrypoints/reasoning.py).
"""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
MLA_DECODE_IMPLS = ("standard", "amla", "amla-triton")  # --mla-decode: absorbed decode attention
# the KV cache is held in the model dtype, or in FP8 e4m3 (vLLM's "fp8" / "fp8_e4m3"; layers/attention/mla.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's --logprobs-mode: raw_* the model's logits before any processor, processed_* the logits sampling draws from
# (sample/logprobs.py); *_logprobs their log-softmax, *_logits the values themselves
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --all2all-backend -> moeserve's --moe-comm
ALL2ALL_BACKENDS = {"allgather_reducescatter": "allgather", "naive": "allgather", "pplx": "alltoall",
                    "deepep_high_throughput": "alltoall", "deepep_low_latency": "alltoall", "deepep_v2": "alltoall",
                    "mori_high_throughput": "alltoall", "mori_low_latency": "alltoall", "nixl_ep": "alltoall",
                    "flashinfer_all2allv": "alltoall", "flashinfer_nvlink_two_sided": "alltoall",
                    "flashinfer_nvlink_one_sided": "alltoall"}
QUANTIZATION_METHODS = ("a8w8", "fp8")
MAX_SLO_MS = 1e9  # about 11.6 days: beyond that a latency target means nothing (and inf is refused)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def check_slo_ms(value, name: str) -> float | None:
    """A latency target in ms as given by a flag or a request field: None, or a finite number in (0, 1e9]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SLO_MS:
        raise ValueError(f"{name} must be a number of milliseconds in (0, {MAX_SLO_MS:g}], got {value!r}")
    return float(value)


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
MOE_COMM_HIERARCHIES = ("flat", "two-stage")
BACKENDS = ("auto", "gloo", "nccl")


ELASTIC_EP_GRAPHS = ("in-use-first", "eager-first")  # --elastic-ep-graphs (engine/elastic_graphs.py)


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
    moe_comm_hierarchy: str = "flat"  # two-stage: allgather / reduce-scatter across nodes, then inside each
    moe_node_size: int | None = None  # EP ranks per node for the MoE collectives (None: D x T / --nnodes)
    moe_pipeline_chunks: int = 1  # dispatch -> experts -> combine over this many chunks of tokens, overlapped
    flashcomm: str = "off"  # attention TP: "on" = ReduceScatter + AllGather, "int8" = INT8 AllGather
    attention_tp_dp_switch: bool = False  # TP attention: low-rank projections on the token shard, then gather
    num_redundant_experts: int = 0
    shared_expert_ranks: int = 0  # EP ranks holding only the shared experts (layers/moe/placement.py)
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
    stall_timeout: float = 5.0  # seconds without progress before a stopped rank is dead (--engine-stall-timeout)
    enable_elastic_ep: bool = False  # survivors ride through the loss of a rank (engine/elastic.py)
    elastic_ep_timeout: float = 60.0  # seconds the survivors may take to re-form before the engine is dead
    elastic_ep_hang_timeout: float = 20.0  # seconds a rank may hold its peers up in a step before it counts as lost
    elastic_ep_replace: bool = False  # the front end starts a replacement for each lost rank (engine/elastic.py)
    elastic_ep_host_copy: bool = False  # each rank keeps its experts in host shared memory (elastic_host_copy.py)
    # a re-formed epoch's decode graphs (elastic_graphs.py), compiled between steps while it serves: "in-use-first"
    # compiles a bucket the ranks' decodes are about to need before that step; "eager-first" decodes eagerly till then
    elastic_ep_graphs: str = "in-use-first"

    def __post_init__(self) -> None:
        _require(self.data_parallel_size >= 1, "--data-parallel-size must be >= 1")
        _require(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")
        _require(self.moe_comm in MOE_COMMS, f"--moe-comm must be one of {', '.join(MOE_COMMS)}, got {self.moe_comm!r}")
        _require(self.moe_comm_dtype in MOE_COMM_DTYPES, f"--moe-comm-dtype must be one of "
                 f"{', '.join(MOE_COMM_DTYPES)}, got {self.moe_comm_dtype!r}")
        _require(self.moe_comm_hierarchy in MOE_COMM_HIERARCHIES, f"--moe-comm-hierarchy must be one of "
                 f"{', '.join(MOE_COMM_HIERARCHIES)}, got {self.moe_comm_hierarchy!r}")
        node = self.moe_node_ranks
        _require(self.moe_node_size is None or (node >= 1 and self.world_size % node == 0),
                 f"--ranks-per-node {self.moe_node_size} must divide the {self.world_size} ranks "
                 "(--data-parallel-size x --tensor-parallel-size)")
        _require(self.moe_comm_hierarchy == "flat" or self.resolved_moe_comm == "allgather",
                 "--moe-comm-hierarchy two-stage is built for --moe-comm allgather (gather across nodes, then "
                 "inside each); add --moe-comm allgather")
        _require(self.moe_comm_hierarchy == "flat" or 1 < node < self.world_size,
                 "--moe-comm-hierarchy two-stage needs more than one node of more than one rank: use --nnodes > 1, "
                 f"or --ranks-per-node N (N dividing the {self.world_size} ranks, 1 < N < {self.world_size}) to "
                 "group the ranks of one machine into simulated nodes")
        _require(self.moe_pipeline_chunks >= 1, f"--moe-pipeline-chunks must be >= 1, got {self.moe_pipeline_chunks}")
        _require(self.moe_pipeline_chunks == 1 or self.world_size > 1,
                 "--moe-pipeline-chunks overlaps the MoE transfers between ranks with the experts' compute: it "
                 "needs --data-parallel-size x --tensor-parallel-size > 1")
        _require(self.flashcomm in ("off", "on", "int8"),
                 f"--flashcomm must be one of off, on, int8, got {self.flashcomm!r}")
        _require(not self.attention_tp_dp_switch or self.tensor_parallel_size > 1,
                 "--attention-tp-dp-switch switches attention between token shards and head shards of the TP "
                 "group: it needs --tensor-parallel-size > 1")
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
        _require(self.shared_expert_ranks >= 0, "--shared-expert-ranks must be >= 0")
        _require(not self.shared_expert_ranks or (self.enable_expert_parallel and self.world_size > 1),
                 "--shared-expert-ranks puts the shared experts on ranks of their own: it needs "
                 "--enable-expert-parallel and --data-parallel-size > 1")
        _require(not self.shared_expert_ranks or self.tensor_parallel_size == 1,
                 "--shared-expert-ranks does not yet combine with --tensor-parallel-size > 1; use "
                 "--data-parallel-size for the ranks")
        _require(self.shared_expert_ranks < self.world_size,
                 f"--shared-expert-ranks {self.shared_expert_ranks} leaves no rank for the routed experts: it must "
                 f"be below the {self.world_size} EP ranks (--data-parallel-size)")
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
        _require(self.stall_timeout > 0, f"--engine-stall-timeout must be > 0 seconds, got {self.stall_timeout}")
        _require(self.elastic_ep_timeout > 0, f"--elastic-ep-timeout must be > 0 seconds, got {self.elastic_ep_timeout}")
        _require(self.elastic_ep_hang_timeout > 0,
                 f"--elastic-ep-hang-timeout must be > 0 seconds, got {self.elastic_ep_hang_timeout}")
        _require(self.enable_elastic_ep or not self.elastic_ep_replace,
                 "--elastic-ep-replace starts a replacement for a lost rank: it needs --enable-elastic-ep")
        _require(self.elastic_ep_graphs in ELASTIC_EP_GRAPHS, f"--elastic-ep-graphs must be one of "
                 f"{', '.join(ELASTIC_EP_GRAPHS)}, got {self.elastic_ep_graphs!r}")
        _require(self.enable_elastic_ep or not self.elastic_ep_host_copy,
                 "--elastic-ep-host-copy keeps the experts for survivors of a lost rank: it needs --enable-elastic-ep")
        if self.enable_elastic_ep:  # survivors re-form one EP group of whole DP ranks (engine/elastic.py)
            _require(self.elastic_ep_hang_timeout < self.distributed_timeout,
                     f"--elastic-ep-hang-timeout {self.elastic_ep_hang_timeout:g} must be below --distributed-timeout "
                     f"{self.distributed_timeout:g}: the peers of a hung rank wait in a collective, which fails the "
                     "engine after --distributed-timeout")
            _require(self.enable_expert_parallel and self.data_parallel_size >= 2,
                     "--enable-elastic-ep rides through the loss of an expert-parallel rank: it needs "
                     "--enable-expert-parallel and --data-parallel-size >= 2")
            _require(self.tensor_parallel_size == 1, "--enable-elastic-ep does not yet support "
                     "--tensor-parallel-size > 1 (a lost rank would take its TP peers down): use "
                     "--data-parallel-size for the ranks")
            _require(self.nnodes == 1, "--enable-elastic-ep runs on one node for now (the front end re-forms the "
                     "ranks it spawned): drop --nnodes")
            _require(self.distributed_backend != "nccl", "--enable-elastic-ep is built on gloo (a survivor leaves "
                     "its step when its peers' sockets close); NCCL ranks cannot leave a collective yet: use "
                     "--distributed-backend gloo (or auto on CPU)")
            for flag, on in (("--shared-expert-ranks", self.shared_expert_ranks),
                             ("--expert-placement", self.expert_placement),
                             ("--moe-comm-hierarchy two-stage", self.moe_comm_hierarchy != "flat")):
                _require(not on, f"--enable-elastic-ep does not yet combine with {flag} (the survivors' layout "
                                 "is recomputed from the default placement); drop one of them")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def token_sharding(self) -> str:
        """FlashComm's mode of the residual stream: --flashcomm, or "on" when the TP<->DP switch needs it."""
        return "on" if self.flashcomm == "off" and self.attention_tp_dp_switch else self.flashcomm

    @property
    def moe_node_ranks(self) -> int:
        """Ranks per node as the MoE collectives see them: --ranks-per-node (simulated nodes), else the real."""
        return self.moe_node_size if self.moe_node_size is not None else self.ranks_per_node

    @property
    def resolved_moe_comm(self) -> str:
        if self.moe_comm != "auto":
            return self.moe_comm
        return "alltoall" if self.enable_expert_parallel else "allgather"


def decode_graph_sizes_up_to(cap: int) -> tuple[int, ...]:
    """The default decode graph buckets below a cap: powers of two, then the cap itself (1, 2, 4, 6 for 6)."""
    sizes, n = [], 1
    while n < cap:
        sizes.append(n)
        n *= 2
    return tuple(sizes + [cap])


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    tokenizer: str | None = None
    seed: int = 0
    mla_decode: str = "standard"  # MLA_DECODE_IMPLS (layers/attention/amla.py)
    load_format: str = "auto"  # dummy: random weights of the checkpoint's shapes, nothing read
    enforce_eager: bool = False  # run the forward eagerly (no compiled / captured decode graphs)
    # Token counts of the compiled decode graphs (engine/compiled_decode.py); None: powers of two up to the
    # batch cap. vLLM's --compilation-config cudagraph_capture_sizes.
    decode_graph_sizes: tuple[int, ...] | None = None
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
        _require(self.decode_graph_sizes is None or (
            self.decode_graph_sizes and all(isinstance(n, int) and n > 0 for n in self.decode_graph_sizes)),
            "--compilation-config cudagraph_capture_sizes must be a non-empty list of positive integers, got "
            f"{self.decode_graph_sizes!r}")
        _require(0 <= self.max_logprobs <= 20, f"--max-logprobs must be in 0..20 (moeserve returns at most 20 "
                 f"alternatives per token), got {self.max_logprobs}")
        _require(self.logprobs_mode in LOGPROBS_MODES,
                 f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")


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
    token) in attention projections, dense MLPs, experts and lm_head (unless `ignore` lists it); embeddings,
    router and norms stay in the model dtype, the KV cache too. "fp8": the same layers but lm_head in block
    FP8 (e4m3 weights, a scale per 128x128 block, layers/fp8.py). checkpoint_format says what the weights on
    disk are: "float" (BF16/FP32; quantized at load), "fp8" (DeepSeek block FP8: kept as is with
    --quantization fp8, dequantized for a8w8 or none) or "compressed-tensors" (INT8 + scales).
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


DEFAULT_MAX_REQUEST_BODY = 32 * 1024 * 1024


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
    engine_standby: bool = True  # the next engine core waits started (imports done): restarts skip that
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
    # vLLM's ops flags (docs/from-vllm.md)
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk
    enable_request_id_headers: bool = False  # answers carry X-Request-Id (the request's, else a fresh one)
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    max_log_len: int | None = None  # --enable-log-requests: also the first N prompt characters and token ids
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    response_role: str = "assistant"  # the role of chat answers (with add_generation_prompt)
    disable_uvicorn_access_log: bool = False
    enable_prompt_tokens_details: bool | None = None  # None: moeserve's default (details always), False: none

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
        _require(self.max_log_len is None or self.max_log_len >= 0,
                 f"--max-log-len must be >= 0, got {self.max_log_len}")
        _require(isinstance(self.response_role, str) and bool(self.response_role.strip()),
                 f"--response-role must be a non-empty role name, got {self.response_role!r}")
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
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                 "--enable-auto-tool-choice needs --tool-call-parser (e.g. deepseek_v3)")
        _require(self.log_level.lower() in ("debug", "info", "warning", "error"),
                 f"--log-level must be debug, info, warning or error, got {self.log_level!r}")
