"""The engine flags' command line: vLLM's short forms, each flag's help text, and the value syntax (sizes such
as 2G, lengths such as 32k) that EngineArgs.add_cli_args (engine_args.py) builds the parser from."""
from __future__ import annotations

import argparse
import re

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
    "enable_elastic_ep": "with -dp >= 2 and expert parallelism: when a rank process dies the survivors re-form "
                         "without it, re-place the experts and finish every request (docs/parallelism.md)",
    "elastic_ep_timeout": "--enable-elastic-ep: seconds the survivors may take to re-form before the engine "
                          "counts as dead",
    "elastic_ep_hang_timeout": "--enable-elastic-ep: seconds a rank may go without beginning a collective while "
                               "its peers wait on it (a hung rank) before it is killed and the others re-form "
                               "without it; below --distributed-timeout",
    "elastic_ep_replace": "--enable-elastic-ep: start a replacement rank process for each lost one; it joins the "
                          "next epoch and the experts spread over the full EP group again",
    "elastic_ep_host_copy": "--enable-elastic-ep: each rank also keeps its routed experts in host shared memory "
                            "(/dev/shm; as much memory again), so the survivors of a loss take a lost expert "
                            "no survivor holds from there instead of the checkpoint",
    "elastic_ep_graphs": "--enable-elastic-ep without --enforce-eager: the re-formed ranks serve at once and compile "
                         "their decode graphs between steps; in-use-first (default) compiles a bucket the ranks' "
                         "decodes are about to need before that step (no eager decode-only step: kept A8W8 "
                         "requests change tokens less often), eager-first decodes eagerly until its bucket's turn",
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
    "logprobs_mode": "what logprobs and prompt_logprobs report: raw_logprobs (log-softmax of the model's logits), "
                     "raw_logits (those logits), processed_logprobs / processed_logits (the same of the logits "
                     "sampling draws from: after logit_bias, penalties, token masks, temperature, top-k/p, min-p)",
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
