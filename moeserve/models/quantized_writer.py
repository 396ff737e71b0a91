"""Write a compressed-tensors W8A8 INT8 checkpoint (`moeserve quantize SRC DST`).

The layout llm-compressor writes and vLLM reads ("format": "int-quantized"): for every quantized Linear an
int8 `weight` [out, in] and a `weight_scale` [out, 1] (float32 here; bf16 scales load too), activations
declared per-token dynamic. Quantized: attention projections, dense and shared MLPs, every routed expert
(written one expert per name, also when the source stores them fused). Left as they are and listed in
`ignore`: lm_head, router gates and the MTP layers (index >= num_hidden_layers). DeepSeek FP8 sources are
dequantized first; their other tensors keep the source dtype (float32 from FP8 becomes bfloat16).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from moeserve.int8 import quantize_per_channel
from moeserve.models.loader import iter_checkpoint
from moeserve.models.quantization import CT_INPUTS, CT_WEIGHTS

_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
                     r"|o_proj)|mlp(\.shared_experts|\.experts\.\d+)?\.(gate_proj|up_proj|down_proj))\.weight$")
_FUSED = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)$")
DEFAULT_SHARD_BYTES = 4 << 30


def compressed_tensors_config(ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**CT_WEIGHTS, "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {**CT_INPUTS, "group_size": None, "observer": None},
            "output_activations": None}},
        "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {},
    }


def _tensors_out(name: str, tensor: torch.Tensor, num_layers: int, from_fp8: bool):
    """(name, tensor) pairs to write for one source tensor."""
    if (m := _LINEAR.match(name)) and int(m.group(1)) < num_layers:
        q, s = quantize_per_channel(tensor)
        yield name, q
        yield name[: -len("weight")] + "weight_scale", s
    elif (f := _FUSED.match(name)) and int(f.group(2)) < num_layers:
        for j in range(tensor.shape[0]):  # fused [E, 2I, H] / [E, H, I] -> one Linear per expert
            if f.group(3) == "down_proj":
                yield from _tensors_out(f"{f.group(1)}.{j}.down_proj.weight", tensor[j], num_layers, from_fp8)
            else:
                gate, up = tensor[j].chunk(2, dim=0)
                yield from _tensors_out(f"{f.group(1)}.{j}.gate_proj.weight", gate, num_layers, from_fp8)
                yield from _tensors_out(f"{f.group(1)}.{j}.up_proj.weight", up, num_layers, from_fp8)
    else:
        yield name, tensor.to(torch.bfloat16) if from_fp8 and tensor.dtype == torch.float32 else tensor


def _ignore_list(cfg: dict) -> list[str]:
    n, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
    return ["lm_head", r"re:.*mlp\.gate$"] + [f"re:model\\.layers\\.{i}\\..*" for i in range(n, n + mtp)]


def quantize_checkpoint(src: str, dst: str, shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """SRC (BF16/FP32/DeepSeek FP8) -> DST in compressed-tensors W8A8. Returns a small summary."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if os.path.isdir(dst) and os.listdir(dst):
        raise ValueError(f"destination {dst!r} exists and is not empty")
    src_q = (cfg.get("quantization_config") or {}).get("quant_method")
    if src_q not in (None, "fp8"):
        raise ValueError(f"{src} is already quantized ({src_q!r}); quantize a BF16/FP32/FP8 checkpoint")
    os.makedirs(dst, exist_ok=True)
    shards, current, size, n_int8 = [], {}, 0, 0
    for name, tensor in iter_checkpoint(src):
        for out_name, t in _tensors_out(name, tensor, cfg["num_hidden_layers"], src_q == "fp8"):
            current[out_name] = t.contiguous()
            size += t.numel() * t.element_size()
            n_int8 += t.dtype == torch.int8
        if size >= shard_bytes:
            shards.append(_save_shard(dst, len(shards), current))
            current, size = {}, 0
    if current or not shards:
        shards.append(_save_shard(dst, len(shards), current))
    _finish(src, dst, cfg, shards)
    return {"shards": len(shards), "int8_tensors": n_int8}


def _save_shard(dst: str, index: int, tensors: dict) -> tuple[str, list[str]]:
    fname = f"shard-{index:05d}.safetensors"
    save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
    return fname, list(tensors)


def _finish(src: str, dst: str, cfg: dict, shards: list[tuple[str, list[str]]]) -> None:
    """Name the shards as HF does, write the index, config.json and copy the other files."""
    if len(shards) == 1:
        os.rename(os.path.join(dst, shards[0][0]), os.path.join(dst, "model.safetensors"))
    else:
        weight_map = {}
        for i, (fname, names) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(os.path.join(dst, fname), os.path.join(dst, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    cfg = {**cfg, "quantization_config": compressed_tensors_config(_ignore_list(cfg))}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if (os.path.isfile(path) and not entry.endswith(".safetensors")
                and entry not in ("config.json", "model.safetensors.index.json")):
            shutil.copy2(path, os.path.join(dst, entry))
