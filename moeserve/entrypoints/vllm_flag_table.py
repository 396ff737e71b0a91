"""Every flag of vLLM 0.32's `vllm serve --help=all` with moeserve's decision (issue 33).

One table decides each flag:
- implemented: `moeserve serve` has the flag, with vLLM's meaning.
- mapped: accepted and translated onto moeserve's own flag (the note says onto which).
- no effect: accepted; one INFO line at start says why it changes nothing here (GPU kernel choices, other
  model families' knobs). Where only some values are harmless (`allowed`), other values are refused naming
  the flag.
- refused: an unknown-flag error that says why and what to use instead.

tests/fixtures/vllm_serve_flags.txt holds vLLM's list; tests/test_vllm_flag_table.py checks that every flag
there has a decision, that every accepted one parses, and that docs/from-vllm.md's flag section is
`python -m moeserve.entrypoints.vllm_flag_table --write docs/from-vllm.md`'s output.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

IMPLEMENTED, MAPPED, NO_EFFECT, REFUSED = "implemented", "mapped", "no effect", "refused"


@dataclass(frozen=True)
class Decision:
    decision: str
    note: str = ""
    kind: str = "value"  # how a no-effect flag added here parses: bool (--x / --no-x), flag, value, list
    allowed: tuple[str, ...] | None = None  # no-effect flags: the only values accepted (None: any)
    aliases: tuple[str, ...] = ()  # vLLM's other spellings (short forms) of a flag added here


TABLE: dict[str, Decision] = {}


def _add(decision: str, note: str, *flags: str, kind: str = "value", allowed: tuple[str, ...] | None = None):
    for spelled in flags:
        name, *aliases = spelled.split()
        assert name not in TABLE, name
        TABLE[name] = Decision(decision, note, kind, allowed, tuple(aliases))


# --- implemented: same name, same meaning --------------------------------------------------------------
_add(IMPLEMENTED, "", "--api-server-count -asc", "--config", "--chat-template", "--enable-auto-tool-choice",
     "--tool-call-parser", "--host", "--port", "--uvicorn-log-level", "--allow-credentials", "--allowed-origins",
     "--allowed-methods", "--allowed-headers", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs",
     "--ssl-cert-reqs", "--root-path", "--model", "--tokenizer", "--seed", "--max-model-len", "--enforce-eager",
     "--max-logprobs", "--skip-tokenizer-init", "--served-model-name", "--generation-config",
     "--override-generation-config", "--load-format", "--reasoning-parser", "--master-addr", "--master-port",
     "--nnodes -n", "--node-rank -r", "--tensor-parallel-size -tp", "--data-parallel-size -dp", "--enable-expert-parallel -ep",
     "--enable-dbo", "--enable-eplb", "--block-size", "--gpu-memory-utilization --device-memory-utilization",
     "--kv-cache-memory-bytes",
     "--kv-cache-dtype", "--enable-prefix-caching", "--log-level", "--max-num-batched-tokens", "--max-num-seqs",
     "--max-num-queued-reqs", "--scheduling-policy", "--enable-chunked-prefill", "--disable-log-stats",
     "--shutdown-timeout", "--enable-log-requests", "--cudagraph-capture-sizes")
_add(IMPLEMENTED, "accepted; moeserve implements DeepSeek V2/V3 itself and never runs code from a checkpoint",
     "--trust-remote-code")
_add(IMPLEMENTED, "with --enable-log-requests the log shows the prompt and its token ids cut to N (without it "
     "moeserve logs prompt lengths, never prompt text)", "--max-log-len")
_add(IMPLEMENTED, "usage carries prompt_tokens_details.cached_tokens (here also without the flag; "
     "--no-enable-prompt-tokens-details leaves it null)", "--enable-prompt-tokens-details")
_add(IMPLEMENTED, "every stream ends with a usage chunk", "--enable-force-include-usage")
_add(IMPLEMENTED, "answers carry X-Request-Id (the request's own, else a fresh uuid4 hex)",
     "--enable-request-id-headers")
_add(IMPLEMENTED, "no /docs, no /openapi.json", "--disable-fastapi-docs")
_add(IMPLEMENTED, "no uvicorn access log line per request", "--disable-uvicorn-access-log")
_add(IMPLEMENTED, "logprob tokens as \"token_id:N\" (a request's return_tokens_as_token_ids overrides)",
     "--return-tokens-as-token-ids")
_add(IMPLEMENTED, "the role of chat answers to a generation prompt", "--response-role")
_add(IMPLEMENTED, "one key (vLLM takes several)", "--api-key")
_add(IMPLEMENTED, "auto, bfloat16, float16 / half, float32 / float", "--dtype")
_add(IMPLEMENTED, "a8w8 (INT8) and fp8 (block FP8); the checkpoint's own when not given", "--quantization -q")
_add(IMPLEMENTED, "raw_logprobs, raw_logits, processed_logprobs, processed_logits", "--logprobs-mode")
_add(IMPLEMENTED, "DeepSeek MTP drafts (method mtp / deepseek_mtp); vLLM's keys draft_tensor_parallel_size, model "
     "(the target), quantization, enforce_eager ... accepted; dotted keys (`--speculative-config.method mtp`) too",
     "--speculative-config -sc")
_add(IMPLEMENTED, "NIXL (kv_connector NixlConnector or nixl), prefill/decode roles; kv_buffer_device and "
     "kv_connector_extra_config accepted without effect", "--kv-transfer-config")
_add(IMPLEMENTED, "the branch, tag or commit of a Hugging Face model id (no effect on a local folder)",
     "--revision")
_add(IMPLEMENTED, "the Hugging Face cache folder a model id is looked up in and downloaded to", "--download-dir")
_add(IMPLEMENTED, "auto, hf, slow, deepseek_v32 load the checkpoint's own tokenizer; others are refused",
     "--tokenizer-mode")
_add(IMPLEMENTED, "only {}: overriding config.json is refused", "--hf-overrides")

# --- mapped onto moeserve's own flags ---------------------------------------------------------------------
_MULTI_NODE = ("onto --nnodes = --data-parallel-size / --data-parallel-size-local, --node-rank = "
               "--data-parallel-start-rank / --data-parallel-size-local, --master-addr = --data-parallel-address, "
               "--master-port = --data-parallel-rpc-port")
_add(MAPPED, _MULTI_NODE, "--data-parallel-size-local -dpl", "--data-parallel-start-rank -dpr",
     "--data-parallel-address -dpa", "--data-parallel-rpc-port -dpp")
_add(MAPPED, "a node other than node 0 (--data-parallel-start-rank > 0) runs ranks and no API server in moeserve "
     "anyway; --headless checks that it is one", "--headless")
_add(MAPPED, "mp only (moeserve spawns its rank processes itself); ray is refused", "--data-parallel-backend -dpb")
_add(MAPPED, "onto --distributed-timeout (seconds a collective may wait)", "--distributed-timeout-seconds",
     "--cpu-distributed-timeout-seconds")
_add(MAPPED, "onto --moe-comm: allgather_reducescatter / naive -> allgather, deepep_* / pplx / ... -> alltoall",
     "--all2all-backend")
_add(MAPPED, "onto --eplb-step-interval / --num-redundant-experts; window_size, log_balancedness, use_async "
     "accepted without effect (loads are counted over the whole step interval)", "--eplb-config")
_add(MAPPED, "onto the compiled decode step: mode/level 0 runs eagerly, cudagraph_capture_sizes / "
     "max_cudagraph_capture_size pick the decode graph sizes", "--compilation-config -cc")
_add(MAPPED, "onto --compilation-config max_cudagraph_capture_size", "--max-cudagraph-capture-size")
_add(MAPPED, "onto --compilation-config mode (0: eager); also -O N", "--optimization-level")
_add(MAPPED, "onto --num-kv-blocks", "--num-gpu-blocks-override")
_add(MAPPED, "onto --speculative-config method / num_speculative_tokens", "--spec-method", "--spec-tokens")
_add(REFUSED, "moeserve drafts with the checkpoint's own MTP layers (--spec-method mtp); there is no draft model",
     "--spec-model")
_add(NO_EFFECT, "LLM.sleep() / wake_up() work without it", "--enable-sleep-mode", kind="bool")

# --- accepted, no effect here ---------------------------------------------------------------------------------
_add(NO_EFFECT, "moeserve's engine schedules each step after the last one's outputs", "--async-scheduling")
_add(NO_EFFECT, "MLA attention is moeserve's own (--mla-decode picks its decode kernel)", "--attention-backend")
_GPU = "a GPU kernel or memory choice; moeserve's CPU kernels have no such switch"
_add(NO_EFFECT, _GPU, "--disable-cascade-attn", "--enable-cumem-allocator", "--enable-nccl-comm-suspend",
     "--sleep-mode-offload-cudagraph", "--disable-custom-all-reduce", "--enable-flashinfer-autotune",
     "--disable-nccl-for-dp-synchronization", "--enable-shm-tensor-arena", "--enable-batch-sharded-sampling",
     "--enable-layerwise-nvtx-tracing", "--kv-sharing-fast-prefill", "--use-fp64-gumbel", kind="bool")
_add(NO_EFFECT, _GPU, "--moe-backend", "--linear-backend", "--sparse-indexer-topk-backend", "--ir-op-priority",
     "--attention-config -ac", "--kernel-config", "--performance-mode", "--dcp-comm-backend")
_OTHER_MODELS = "configures a layer kind DeepSeek V2/V3 do not have (Mamba, linear attention, sliding window)"
_add(NO_EFFECT, _OTHER_MODELS, "--mamba-backend", "--mamba-ssu-algorithm", "--mamba-cache-philox-rounds",
     "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--mamba-block-size", "--mamba-cache-mode",
     "--replayssm-buffer-len", "--gdn-prefill-backend", "--kda-prefill-backend", "--kda-decode-backend")
_add(NO_EFFECT, _OTHER_MODELS, "--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint",
     "--use-replayssm", "--disable-sliding-window", "--swa-bounded-replay", "--disable-hybrid-kv-cache-manager",
     kind="bool")
_TEXT = "DeepSeek V2/V3 are text-only: there is no image, audio or video input to configure"
_add(NO_EFFECT, _TEXT, "--limit-mm-per-prompt", "--media-io-kwargs", "--mm-processor-kwargs",
     "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-hasher-algorithm",
     "--mm-shm-cache-max-object-size-mb", "--mm-encoder-tp-mode", "--mm-encoder-attn-backend",
     "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-path",
     "--mm-encoder-fp8-scale-save-margin", "--video-pruning-rate", "--video-pruning-method", "--mm-tensor-ipc",
     "--mm-processor-device", "--mm-ipc-gpu-memory-gb", "--allowed-local-media-path")
_add(NO_EFFECT, _TEXT, "--allowed-media-domains", kind="list")
_add(NO_EFFECT, _TEXT, "--language-model-only", "--enable-mm-embeds", "--interleave-mm-strings",
     "--skip-mm-profiling", "--mm-device-do-normalize", "--trust-request-mm-kwargs", "--disable-chunked-mm-input",
     kind="bool")
_LOAD = "moeserve reads safetensors files with its own loader"
_add(NO_EFFECT, _LOAD, "--safetensors-load-strategy", "--safetensors-prefetch-num-threads",
     "--safetensors-prefetch-block-size", "--max-parallel-loading-workers", "--pt-load-map-location")
_add(NO_EFFECT, _LOAD, "--use-tqdm-on-load", kind="bool")
_add(NO_EFFECT, "moeserve runs no code from a checkpoint, so there is no code revision", "--code-revision")
_add(NO_EFFECT, "the tokenizer is read from the model's own folder or snapshot (--revision)", "--tokenizer-revision")
_add(NO_EFFECT, "no deprecated quantization methods exist here", "--allow-deprecated-quantization", kind="bool")
_add(NO_EFFECT, "moeserve's own DeepSeek implementation is the only one", "--model-impl",
     allowed=("auto", "vllm"))
_add(NO_EFFECT, "moeserve runs text generation only", "--runner", allowed=("auto", "generate"))
_add(NO_EFFECT, "moeserve runs text generation only", "--convert", allowed=("auto", "none"))
_add(NO_EFFECT, "config.json in the model folder is read", "--config-format", allowed=("auto", "hf"))
_add(NO_EFFECT, "chat message content is rendered as a string", "--chat-template-content-format",
     allowed=("auto", "string"))
_add(NO_EFFECT, "the API servers tokenize in their own process", "--renderer-num-workers")
_add(NO_EFFECT, "the launcher watches its DP ranks itself (--engine-stall-timeout, --max-engine-restarts)",
     "--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s",
     "--dp-supervisor-probe-failure-threshold", "--dp-sync-interval")
_add(NO_EFFECT, "thread placement is left to OMP_NUM_THREADS / numactl", "--numa-bind", kind="bool")
_add(NO_EFFECT, "thread placement is left to OMP_NUM_THREADS / numactl", "--numa-bind-nodes", "--numa-bind-cpus",
     kind="list")
_add(NO_EFFECT, "--enable-dbo splits every step into two micro-batches", "--ubatch-size",
     "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold")
_add(NO_EFFECT, "each EP rank loads only the experts it holds", "--enable-ep-weight-filter", kind="bool")
_add(NO_EFFECT, "prefix-cache block hashes are moeserve's own", "--prefix-caching-hash-algo")
_add(NO_EFFECT, "prompts are chunked by --max-num-batched-tokens", "--long-prefill-token-threshold",
     "--prefill-schedule-interval", "--watermark")
_add(NO_EFFECT, "prompts are chunked by --max-num-batched-tokens", "--long-prefill-token-threshold-adaptive",
     "--scheduler-reserve-full-isl", kind="bool")
_add(NO_EFFECT, "the engine logs one stats line per DP rank", "--aggregate-engine-logging", kind="flag")
_add(NO_EFFECT, "moeserve reads no VLLM_* environment variables", "--fail-on-environ-validation", kind="bool")
_add(NO_EFFECT, "/metrics has no hidden metrics", "--show-hidden-metrics-for-version")
_add(NO_EFFECT, "error answers carry their message; tracebacks go to the log at ERROR", "--log-error-stack",
     kind="bool")
_add(NO_EFFECT, "/load is always served", "--enable-server-load-tracking", kind="bool")
_add(NO_EFFECT, "uvicorn's h11 limits apply", "--h11-max-incomplete-event-size", "--h11-max-header-count")
_add(NO_EFFECT, "/docs is FastAPI's default page", "--enable-offline-docs", kind="bool")
_add(NO_EFFECT, "moeserve has its own grammar engine", "--structured-outputs-config")
_add(NO_EFFECT, "DP ranks are placed by expert id (--expert-placement FILE for another placement)",
     "--expert-placement-strategy", allowed=("linear",))
_add(NO_EFFECT, "moeserve streams each token as it is generated", "--stream-interval", allowed=("1",))
_add(NO_EFFECT, "decode context parallelism is not implemented; 1 is the only size", "--decode-context-parallel-size "
     "-dcp", "--prefill-context-parallel-size -pcp", allowed=("1",))
_add(NO_EFFECT, "context parallelism is not implemented (size 1)", "--dcp-kv-cache-interleave-size",
     "--cp-kv-cache-interleave-size")
_add(NO_EFFECT, "context parallelism is not implemented (size 1)", "--dcp-q-replicate", kind="bool")
_add(NO_EFFECT, "pipeline parallelism is not implemented: use -tp, -dp and -ep", "--pipeline-parallel-size -pp",
     allowed=("1",))
_add(NO_EFFECT, "moeserve spawns its rank processes itself (torchrun's environment is honoured too)",
     "--distributed-executor-backend", allowed=("mp", "uni", "external_launcher"))

# --- refused: why, and what to use --------------------------------------------------------------------------
_add(REFUSED, "LoRA adapters are not supported", "--lora-modules", "--enable-lora", "--max-loras",
     "--max-lora-rank", "--lora-dtype", "--enable-tower-connector-lora", "--max-cpu-loras", "--fully-sharded-loras",
     "--lora-target-modules", "--default-mm-loras", "--specialize-active-lora", "--enable-mixed-moe-lora-format",
     "--enable-moe-shared-loras", "--max-lora-cls-labels")
_add(REFUSED, "moeserve serves HTTP only (OpenAI, Anthropic Messages, Responses)", "--grpc", "--grpc-port", "--uds")
_add(REFUSED, "plugins are not loaded: the DeepSeek tool-call and reasoning parsers are built in "
     "(--tool-call-parser, --reasoning-parser)", "--tool-parser-plugin", "--reasoning-parser-plugin",
     "--io-processor-plugin", "--logits-processors")
_add(REFUSED, "code is never imported from flags (custom classes are not supported)", "--worker-cls",
     "--worker-extension-cls", "--scheduler-cls", "--model-class-overrides", "--middleware")
_add(REFUSED, "pooling / embedding models are not supported (text generation only)", "--pooler-config",
     "--enable-flash-late-interaction")
_add(REFUSED, "Ray is not used: moeserve spawns its rank processes (use -dp / --nnodes)",
     "--ray-workers-use-nsight")
_add(REFUSED, "external / hybrid DP load balancing is not supported: one `moeserve serve -dp N` deployment balances "
     "its ranks (or several instances behind `moeserve proxy`)", "--data-parallel-rank -dpn",
     "--data-parallel-hybrid-lb -dph", "--data-parallel-external-lb -dpe", "--data-parallel-multi-port-external-lb -dpm")
_add(IMPLEMENTED, "rides through the loss of a rank (the survivors re-form without it); growing the DP size is "
     "not supported yet", "--enable-elastic-ep", kind="bool")
_add(REFUSED, "growing an elastic EP engine is not supported yet: --enable-elastic-ep rides through the loss of a "
     "rank; restart with another -dp to grow", "--elastic-ep-max-dp-size")
_add(REFUSED, "engine-core deaths are restarted by the launcher (--max-engine-restarts, --engine-restart-backoff)",
     "--enable-fault-tolerance", "--fault-tolerance-config")
_add(REFUSED, "weights and KV cache offloading are not supported (size the KV pool with --kv-cache-memory or "
     "--gpu-memory-utilization)", "--kv-offloading-size", "--kv-offloading-backend", "--offload-backend",
     "--cpu-offload-gb", "--cpu-offload-params", "--offload-group-size", "--offload-num-in-group",
     "--offload-prefetch-step", "--offload-params")
_add(REFUSED, "OpenTelemetry tracing is not supported (/metrics and --enable-log-requests instead)",
     "--otlp-traces-endpoint", "--collect-detailed-traces")
_add(REFUSED, "not implemented: /metrics carries vLLM's standard metrics (docs/from-vllm.md)",
     "--per-request-spec-decode-metrics", "--kv-cache-metrics", "--kv-cache-metrics-sample",
     "--custom-histogram-buckets", "--cudagraph-metrics", "--enable-mfu-metrics", "--enable-per-request-metrics",
     "--enable-logging-iteration-details")
_add(REFUSED, "not implemented: --enable-log-requests logs each request's id, lengths and parameters",
     "--enable-log-outputs", "--enable-log-deltas")
_add(REFUSED, "logging is configured by --log-level and --uvicorn-log-level", "--logging-config",
     "--log-config-file")
_add(REFUSED, "not implemented: the prefix cache evicts least recently used blocks",
     "--prefix-cache-retention-interval")
_add(REFUSED, "not implemented: every layer's KV cache is stored in --kv-cache-dtype", "--kv-cache-dtype-skip-layers")
_add(REFUSED, "not implemented: --max-num-batched-tokens and --max-num-seqs bound a step", "--max-num-scheduled-tokens",
     "--max-num-active-seqs")
_add(REFUSED, "not implemented: bound the queue with --max-num-queued-reqs or --max-waiting-requests",
     "--max-num-queued-tokens")
_add(REFUSED, "quantization is picked by --quantization (a8w8, fp8) or the checkpoint", "--quantization-config")
_add(REFUSED, "not implemented", "--enable-return-routed-experts", "--return-sampling-mask", "--enable-trace-replay",
     "--tokens-only", "--enable-scale-out", "--fingerprint-mode", "--fingerprint-value", "--jit-monitor-mode",
     "--jit-monitor-verbose", "--enable-hc-sp", "--prefix-match-unit", "--sse-keep-alive-interval",
     "--enable-tokenizer-info-endpoint", "--tool-strict-level", "--tool-server",
     "--exclude-tools-when-tool-choice-none", "--default-chat-template-kwargs", "--anthropic-disabled-thinking-effort",
     "--disable-access-log-for-endpoints", "--enable-ssl-refresh", "--ssl-ciphers", "--device-ids",
     "--sleep-preserve-parameter-names", "--model-loader-extra-config", "--ignore-patterns")
_add(REFUSED, "per-request chat templates are refused (set --chat-template at start)", "--trust-request-chat-template")
_add(REFUSED, "prompt embeddings are not supported (token ids or text)", "--enable-prompt-embeds")
_add(REFUSED, "Cohere's API is not served", "--cohere-is-reasoning-model", "--cohere-format")
_add(REFUSED, "a separate config.json is not read: the model folder's is", "--hf-config-path")
_add(REFUSED, "set HF_TOKEN in the environment (huggingface_hub reads it when it downloads a model id)",
     "--hf-token")
_add(REFUSED, "watermarking is not supported", "--watermark-config")
_add(REFUSED, "diffusion models are not supported", "--diffusion-config -dc")
_add(REFUSED, "KV cache events are not published", "--kv-events-config")
_add(REFUSED, "encoder caches are for multimodal models; DeepSeek V2/V3 are text-only", "--ec-transfer-config",
     "--ec-manager-config", "--mm-encoder-only")
_add(REFUSED, "not implemented (engram, reasoning, aux-output, profiler and weight-transfer configs)",
     "--engram-config", "--reasoning-config", "--aux-output-config", "--profiler-config", "--weight-transfer-config",
     "--additional-config")


def hint(flag: str) -> str | None:
    """What an unknown-flag error says of a vLLM flag moeserve refuses (None: not a refused vLLM flag)."""
    name = flag.split("=", 1)[0]
    if name.startswith("--no-"):
        name = "--" + name[5:]
    for key, d in TABLE.items():
        if d.decision == REFUSED and (name == key or name in d.aliases):
            return d.note
    return None


def add_accepted_flags(parser: argparse.ArgumentParser) -> None:
    """The no-effect and mapped vLLM flags `serve` lacks so far, added to its parser (they log at start)."""
    known = {o for a in parser._actions for o in a.option_strings}
    group = None
    for name, d in TABLE.items():
        if d.decision not in (NO_EFFECT, MAPPED) or name in known or name in _HANDLED_ELSEWHERE:
            continue
        group = group or parser.add_argument_group("vLLM flags accepted without effect here (docs/from-vllm.md)")
        text = f"accepted; no effect: {d.note}" if d.decision == NO_EFFECT else d.note
        if d.allowed:
            text += f" (accepted values: {', '.join(d.allowed)})"
        kw: dict = {"default": None, "help": text.replace("%", "%%") + " (default: not given)"}
        if d.kind in ("value", "list"):
            kw["metavar"] = "VALUE"
        if d.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif d.kind == "flag":
            kw.update(action="store_const", const=True)
        elif d.kind == "list":
            kw["nargs"] = "+"
        group.add_argument(name, *d.aliases, dest="vllm_" + name[2:].replace("-", "_"), **kw)


# mapped flags whose translation lives with the flags they map onto (EngineArgs or serve_cli)
_HANDLED_ELSEWHERE = {"--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                      "--data-parallel-rpc-port", "--headless", "--data-parallel-backend",
                      "--distributed-timeout-seconds", "--cpu-distributed-timeout-seconds",
                      "--max-cudagraph-capture-size", "--optimization-level", "--num-gpu-blocks-override",
                      "--spec-method", "--spec-tokens"}


def check_accepted_flags(args: argparse.Namespace, log) -> None:
    """The no-effect flags given: refuse a value outside `allowed` naming the flag, log the others (INFO, once)."""
    for name, d in TABLE.items():
        dest = "vllm_" + name[2:].replace("-", "_")
        value = getattr(args, dest, None)
        if value is None or value is False or d.decision != NO_EFFECT:
            continue
        if d.allowed is not None and str(value) not in d.allowed:
            raise ValueError(f"{name} {value}: {d.note}; accepted values: {', '.join(d.allowed)}")
        log.info("%s has no effect here: %s", name, d.note)


def markdown() -> str:
    """docs/from-vllm.md's flag table: one row per vLLM flag, in vLLM's order of --help=all."""
    rows = ["| vLLM flag | moeserve | why / what to use |", "| --- | --- | --- |"]
    for name, d in TABLE.items():
        spelled = " ".join(f"`{s}`" for s in (name, *d.aliases))
        note = d.note or "same meaning"
        if d.allowed:
            note += f" (accepted: {', '.join(d.allowed)})"
        rows.append(f"| {spelled} | {d.decision} | {note} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- vllm-flag-table: begin (generated) -->", "<!-- vllm-flag-table: end -->"


def render_doc(text: str) -> str:
    """text (docs/from-vllm.md) with the part between BEGIN and END replaced by markdown()."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the doc lacks the markers {BEGIN} ... {END}")
    counts = {k: sum(d.decision == k for d in TABLE.values()) for k in (IMPLEMENTED, MAPPED, NO_EFFECT, REFUSED)}
    summary = (f"{len(TABLE)} flags: " + ", ".join(f"{n} {k}" for k, n in counts.items()) +
               " (generated from moeserve/entrypoints/vllm_flag_table.py).\n\n")
    return head + BEGIN + "\n" + summary + markdown() + END + tail


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--write":
        with open(argv[1]) as f:
            text = f.read()
        with open(argv[1], "w") as f:
            f.write(render_doc(text))
        return 0
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
