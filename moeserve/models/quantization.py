"""Quantization at the model level: which config a checkpoint implies, and which layers take INT8 or FP8.

- resolve_quant_config: --quantization plus the checkpoint's quantization_config -> QuantConfig. DeepSeek
  block FP8 ("quant_method": "fp8", 128x128 blocks) turns fp8 on by itself (its weights stay FP8, as in
  vLLM); with --quantization a8w8 the loader dequantizes it and the layers re-quantize to INT8.
  compressed-tensors W8A8 INT8 (as llm-compressor writes and vLLM reads) turns a8w8 on by itself.
- apply_quantization: on the meta-device model, before loading. Every Linear (attention projections,
  kv_b_proj included, dense and shared MLPs) gets the INT8 (FP8) method and every FusedExperts becomes
  Int8FusedExperts (Fp8FusedExperts), except modules the checkpoint lists in `ignore`. lm_head is a Linear
  too: INT8 under a8w8 (unless ignored, as llm-compressor's checkpoints do), the model dtype under fp8.
  Embeddings, router (Router), the MTP head (nn.Linear) and norms stay in the model dtype.
"""
from __future__ import annotations

import json
import os
import re

from torch import nn

from moeserve.config import ConfigError, QuantConfig
from moeserve.layers.fp8 import BLOCK as FP8_BLOCK
from moeserve.layers.fp8 import Fp8FusedExperts, Fp8LinearMethod
from moeserve.layers.linear import Linear
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.quant import Int8FusedExperts, Int8LinearMethod

# What moeserve's a8w8 is, in compressed-tensors terms (weights / input_activations of a config group).
CT_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
CT_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
CT_FORMATS = ("int-quantized", "naive-quantized")


def checkpoint_quantization(path: str) -> dict | None:
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg) as f:
        try:
            return json.load(f).get("quantization_config")
        except json.JSONDecodeError:
            return None  # DeepseekArch.from_pretrained reports the broken file


def resolve_quant_config(requested: str | None, path: str) -> QuantConfig:
    qc = checkpoint_quantization(path)
    kind = (qc or {}).get("quant_method")
    if qc is None:
        return QuantConfig(method=requested)
    if kind == "fp8":
        _check_block_fp8(qc)
        return QuantConfig(method=requested or "fp8", checkpoint_format="fp8")
    if kind != "compressed-tensors":
        raise ConfigError(f"checkpoint quantization {kind!r} is not supported: moeserve reads DeepSeek FP8 "
                          "block-scaled and compressed-tensors W8A8 INT8 checkpoints")
    _check_compressed_tensors(qc)
    return QuantConfig(method=requested or "a8w8", checkpoint_format="compressed-tensors",
                       ignore=tuple(qc.get("ignore") or ()))


def _check_block_fp8(qc: dict) -> None:
    """DeepSeek's layout: e4m3, dynamic activations, 128x128 weight blocks (what the loader reads)."""
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ConfigError(f"FP8 weight_block_size {block} is not supported: moeserve reads "
                          f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks (DeepSeek-V3's)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"FP8 fmt {fmt!r} is not supported: moeserve reads e4m3 (float8_e4m3fn) weights")


def _check_compressed_tensors(qc: dict) -> None:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise ConfigError(f"compressed-tensors format {fmt!r} is not supported (need one of {', '.join(CT_FORMATS)})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    for gname, group in groups.items():
        for key, want in (("weights", CT_WEIGHTS), ("input_activations", CT_INPUTS)):
            got = group.get(key) or {}
            bad = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
            if bad:
                raise ConfigError(f"compressed-tensors group {gname!r} {key} {bad} is not W8A8 INT8 "
                                  f"(moeserve runs {want})")


def is_ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors `ignore`: exact module names or 're:<regex>' patterns (re.match)."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


def _experts_ignored(prefix: str, experts: FusedExperts, ignore: tuple[str, ...]) -> bool:
    flags = {is_ignored(f"{prefix}.{e}.{p}", ignore)
             for e in experts.held_experts() for p in ("gate_proj", "up_proj", "down_proj")}
    if len(flags) > 1:
        raise ConfigError(f"{prefix}: the checkpoint ignores some experts' projections but not others; "
                          "moeserve quantizes a layer's experts all or none")
    return flags == {True}


def apply_quantization(model: nn.Module, quant: QuantConfig) -> None:
    """Give the quantizable layers their INT8 / FP8 storage (call before loading weights)."""
    if quant.method is None:
        return
    linear_method, experts_cls = ((Fp8LinearMethod, Fp8FusedExperts) if quant.method == "fp8"
                                  else (Int8LinearMethod, Int8FusedExperts))
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and not is_ignored(name, quant.ignore):
            if quant.method == "fp8" and name == "lm_head":
                continue  # DeepSeek's FP8 checkpoints keep the head in BF16, and so does vLLM
            if quant.method == "fp8":
                linear_method.create_weights(module, float_stays_float=quant.checkpoint_format == "fp8")
            else:
                linear_method.create_weights(module)
        elif isinstance(module, FusedExperts) and not _experts_ignored(name, module, quant.ignore):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, experts_cls.like(module))
