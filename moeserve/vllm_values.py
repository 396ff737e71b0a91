"""vLLM's JSON-valued engine flags translated to moeserve's fields: --compilation-config, --speculative-config,
--kv-transfer-config and --eplb-config take vLLM's keys and values; a key that changes nothing here is accepted
and logged once, a value moeserve cannot honour is an error naming the key."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moeserve.config import _parse_json_dict, _require

if TYPE_CHECKING:
    from moeserve.engine_args import EngineArgs

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


def note_once(key: str, message: str, *args) -> None:
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
                note_once(f"spec:{key}", "--speculative-config %s %s: the MTP layers run on the target's ranks "
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
                note_once(f"spec:{key}", "--speculative-config %s has no effect here: %s", key, why)
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
                note_once(f"kv:{key}", "--kv-transfer-config %s has no effect here: %s", key, why)
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
            note_once(f"eplb:{key}", "--eplb-config %s has no effect here: %s", key, why)
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
