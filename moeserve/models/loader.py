"""Load Hugging Face safetensors checkpoints into a moeserve model.

- Shards listed by model.safetensors.index.json, or every *.safetensors in the folder.
- DeepSeek FP8: float8_e4m3fn weights with `<name>_scale_inv` 128x128 block scales, the scale found in
  whichever shard holds it. They reach an FP8 layer (layers/fp8.py) as Fp8Weight, untouched; any other
  target (a float or INT8 layer) gets them dequantized, one tensor at a time.
- MTP layers (decoder index >= num_hidden_layers) are kept aside (LoadedCheckpoint.mtp_weights) when
  speculative decoding asks for them, and otherwise never read (DeepSeek-V3's is ~14B parameters).
- Routed experts `mlp.experts.{j}.{gate,up,down}_proj.weight` go into the stacked per-layer tensors; only
  experts this rank holds are read (FusedExperts.held_experts; the MTP layer's from the MoE plan), and none
  of those that experts_supplied() names (elastic EP: a replacement rank receives them from its peers).
Every failure names the tensor or file and what was expected.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from tqdm import tqdm

from moeserve.layers.fp8 import Fp8Weight, tp_slice_fp8
from moeserve.layers.moe.experts import FusedExperts
from moeserve.scoped import Scoped

logger = logging.getLogger(__name__)

FP8_BLOCK = 128
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"(weight|weight_scale|weight_zero_point)$")  # scales: compressed-tensors INT8
_FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARED_EXPERT = re.compile(r"^(.*\.mlp)\.shared_experts\.")  # the MoE block owning a shared expert


class CheckpointError(ValueError):
    pass


@dataclass
class LoadedCheckpoint:
    mtp_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # names as in the file
    num_tensors: int = 0
    num_expert_tensors: int = 0  # routed-expert tensors among num_tensors (MTP layer's included)


_SUPPLIED: Scoped[dict[int, set[int]]] = Scoped("loader_supplied_experts")


def experts_supplied(supplied: dict[int, set[int]] | None):
    """load_weights() (and the MTP layer's load) inside reads no tensor of these routed experts ({decoder layer:
    logical experts}) and leaves their slots unset for the caller to fill: elastic EP's replacement rank
    receives them from the survivors or the host copy (engine/elastic_replace.py)."""
    return _SUPPLIED.use(supplied)


def _supplied(prefix: str) -> set[int]:
    """The experts of experts module `prefix` (model.layers.{i}.mlp.experts) that experts_supplied() names."""
    m = _LAYER.match(prefix)
    return (_SUPPLIED.get() or {}).get(int(m.group(1)), set()) if m else set()


def checkpoint_files(path: str) -> dict[str, list[str]]:
    """file -> tensor names in it (names None = read all)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(os.path.join(path, fname), []).append(name)
        for fname in files:
            if not os.path.isfile(fname):
                raise CheckpointError(f"{index} lists {os.path.basename(fname)}, which is missing")
        return files
    found = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not found:
        raise CheckpointError(f"no *.safetensors files in {path!r}")
    return {f: None for f in found}


def _check_scale_shape(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "") -> None:
    out_f, in_f = weight.shape
    expected = (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"FP8 scale {name}_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                              f"{tuple(weight.shape)} (expected {expected})")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek FP8: weight [out, in] e4m3 times one scale per 128x128 block, scale_inv [ceil(out/128), ceil(in/128)]."""
    _check_scale_shape(weight, scale_inv)
    out_f, in_f = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out_f].repeat_interleave(FP8_BLOCK, 1)[:, :in_f]
    return weight.float() * scale


def iter_checkpoint(path: str, skip=None, keep_fp8: bool = False):
    """Yield (name, tensor) for every weight; FP8 weights dequantized to float32, or as Fp8Weight (the e4m3
    tensor with its block scales) when keep_fp8.

    skip(name) -> True leaves a tensor unread (not loaded, not dequantized).
    """
    files = checkpoint_files(path)
    file_names = {fname: set(names) if names is not None else set(_header_names(fname)) for fname, names in
                  files.items()}
    owner = {name: fname for fname, names in file_names.items() for name in names}  # scales may sit anywhere
    total = sum(os.path.getsize(f) for f in files)
    for fname in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=total < (1 << 30)):
        with _open(fname) as f:
            for name in sorted(file_names[fname]):
                if name.endswith("_scale_inv") or (skip is not None and skip(name)):
                    continue
                tensor = _read(f, fname, name)
                if tensor.dtype == torch.float8_e4m3fn:
                    tensor = _with_scale(tensor, name, fname, f, owner, keep_fp8)
                yield name, tensor


def _open(fname: str):
    try:
        return safe_open(fname, framework="pt")
    except Exception as e:  # safetensors raises several error types for damaged headers
        raise CheckpointError(f"cannot read {fname}: the file is corrupt or not safetensors ({e})") from e


def _header_names(fname: str) -> list[str]:
    with _open(fname) as f:
        return list(f.keys())


def _read(handle, fname: str, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {fname}: {e}") from e


def _with_scale(q: torch.Tensor, name: str, fname: str, handle, owner: dict[str, str], keep_fp8: bool):
    """Pair an FP8 weight with its weight_scale_inv, from this shard or another one."""
    scale_name = name + "_scale_inv"
    scale_file = owner.get(scale_name)
    if scale_file is None:
        raise CheckpointError(f"FP8 tensor {name} in {fname} has no {scale_name} in any shard")
    if scale_file == fname:
        scale = _read(handle, fname, scale_name)
    else:
        with _open(scale_file) as other:
            scale = _read(other, scale_file, scale_name)
    if q.dim() != 2:
        raise CheckpointError(f"FP8 tensor {name} has shape {tuple(q.shape)}: block FP8 weights are 2-D")
    _check_scale_shape(q, scale, name)
    return Fp8Weight(q, scale.float()) if keep_fp8 else dequantize_fp8(q, scale)


def has_mtp_tensors(path: str, num_hidden_layers: int) -> bool:
    """Whether the checkpoint ships an MTP layer (reads only the index or the safetensors headers)."""
    for fname, names in checkpoint_files(path).items():
        if names is None:
            with safe_open(fname, framework="pt") as handle:
                names = list(handle.keys())
        if any(is_mtp_tensor(n, num_hidden_layers) for n in names):
            return True
    return False


def is_mtp_tensor(name: str, num_hidden_layers: int) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= num_hidden_layers


def load_weights(model: torch.nn.Module, path: str, keep_mtp: bool = False) -> LoadedCheckpoint:
    """Copy the checkpoint at `path` into `model` (built for the same config). Strict about gaps.

    Tensors of layers >= num_hidden_layers (MTP) go to result.mtp_weights instead (see speculative/mtp_model.py)
    if keep_mtp; otherwise they are not read at all.
    """
    result = LoadedCheckpoint()
    layers = model.arch.num_hidden_layers
    held = {n: m.held_experts() for n, m in model.named_modules() if isinstance(m, FusedExperts)}

    def skip(name: str) -> bool:
        if is_mtp_tensor(name, layers) and not keep_mtp:
            return True
        em = _EXPERT.match(name)  # a routed expert another rank holds, or one a peer supplies: not read
        if em is None:
            return False
        prefix, expert = em.group(1), int(em.group(2))
        if prefix not in held:
            held[prefix] = _plan_held(prefix, model.arch)
        return expert not in held[prefix] or expert in _supplied(prefix)

    def main_tensors():
        for name, tensor in iter_checkpoint(path, skip, keep_fp8=True):
            result.num_tensors += 1
            result.num_expert_tensors += _EXPERT.match(name) is not None
            if is_mtp_tensor(name, layers):
                result.mtp_weights[name] = tensor
                continue
            yield name, tensor

    load_named_tensors(model, main_tensors())
    return result


def _plan_held(prefix: str, arch) -> set[int]:
    """The experts this rank holds in an experts module the model lacks (the MTP layer's, read before it is
    built): the MoE plan's placement the model is built under; every expert without a plan."""
    from moeserve.layers.moe.placement import current_layer_placement

    n = arch.n_routed_experts or 0
    return set(current_layer_placement(int(_LAYER.match(prefix).group(1)), n)[1].local_slot_experts())


def load_named_tensors(model: torch.nn.Module, tensors) -> None:
    """Copy (checkpoint name, tensor) pairs into the parameters of the same names; strict about gaps.

    `model` has an `arch` and names its parameters as the checkpoint does; routed experts are stacked.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expert_modules = {n: m for n, m in modules.items() if isinstance(m, FusedExperts)}
    loaded: set[str] = set()
    for name, tensor in tensors:
        if _on_shared_expert_ranks(name, modules):
            continue
        if isinstance(tensor, Fp8Weight) and not _takes_fp8(name, modules, expert_modules):
            tensor = tensor.dequantize()
        if (em := _EXPERT.match(name)) and em.group(1) in expert_modules:
            _load_expert(expert_modules[em.group(1)], em.group(1), int(em.group(2)), em.group(3), tensor, loaded,
                         em.group(4))
            continue
        if (fm := _FUSED_EXPERT.match(name)) and fm.group(1) in expert_modules:
            experts = expert_modules[fm.group(1)]
            for j in range(tensor.shape[0]):
                if fm.group(2) == "down_proj":
                    _load_expert(experts, fm.group(1), j, "down_proj", tensor[j], loaded)
                else:
                    gate, up = tensor[j].chunk(2, dim=0)
                    _load_expert(experts, fm.group(1), j, "gate_proj", gate, loaded)
                    _load_expert(experts, fm.group(1), j, "up_proj", up, loaded)
            continue
        owner, _, leaf = name.rpartition(".")
        if isinstance(tensor, Fp8Weight):
            tensor = tp_slice_fp8(modules[owner], tensor)
        elif hasattr(modules.get(owner), "tp_slice"):  # tensor-parallel layers keep their slice only
            tensor = modules[owner].tp_slice(leaf, tensor)
        if getattr(modules.get(owner), "quant_method", None) is not None:  # quantized Linear: it loads itself
            loaded.update(f"{owner}.{p}" for p in _quant_call(modules[owner].quant_method.load_tensor,
                                                              modules[owner], leaf, tensor, name))
            continue
        param = params.get(name)
        if param is None:
            if "rotary_emb" not in name:
                logger.warning("ignoring checkpoint tensor %s (no such parameter)", name)
            continue
        _copy(param, tensor, name)
        loaded.add(name)
    _check_complete(model, params, expert_modules, loaded)


def load_expert_slots(model: torch.nn.Module, path: str, wanted: dict[str, dict[int, list[int]]]) -> int:
    """Read only the routed experts `wanted` ({experts module name: {logical expert: [local slots]}}) from the
    checkpoint into those slots; no other tensor is read (elastic EP: the experts a survivor takes over from a
    lost rank, engine/elastic.py). Returns the tensors read."""
    modules = dict(model.named_modules())
    expert_modules = {n: m for n, m in modules.items() if isinstance(m, FusedExperts)}

    def skip(name: str) -> bool:
        if (em := _EXPERT.match(name)) is not None:
            return int(em.group(2)) not in wanted.get(em.group(1), ())
        fm = _FUSED_EXPERT.match(name)  # all experts in one tensor: read whole where one is wanted
        return fm is None or not wanted.get(fm.group(1))

    def fill(prefix: str, expert: int, proj: str, tensor: torch.Tensor, leaf: str = "weight") -> None:
        experts, name = expert_modules[prefix], f"{prefix}.{expert}.{proj}.{leaf}"
        filled.add(f"{prefix}.{expert}.{proj}")
        for slot in wanted[prefix].get(expert, ()):
            _quant_call(experts.load_expert, slot, proj, leaf, experts.shard(proj, tensor, leaf), name)

    read, filled = 0, set()
    if not any(wanted.values()):
        return read
    for name, tensor in iter_checkpoint(path, skip, keep_fp8=True):
        read += 1
        if isinstance(tensor, Fp8Weight) and not _takes_fp8(name, modules, expert_modules):
            tensor = tensor.dequantize()
        if (em := _EXPERT.match(name)) is not None:
            fill(em.group(1), int(em.group(2)), em.group(3), tensor, em.group(4))
        elif (fm := _FUSED_EXPERT.match(name)) is not None:
            for j in wanted[fm.group(1)]:
                if fm.group(2) == "down_proj":
                    fill(fm.group(1), j, "down_proj", tensor[j])
                else:
                    gate, up = tensor[j].chunk(2, dim=0)
                    fill(fm.group(1), j, "gate_proj", gate)
                    fill(fm.group(1), j, "up_proj", up)
    missing = [n for prefix, experts in wanted.items() for e in experts
               for proj in ("gate_proj", "up_proj", "down_proj") if (n := f"{prefix}.{e}.{proj}") not in filled]
    if missing:
        raise CheckpointError(f"the checkpoint is missing tensor(s): {', '.join(missing[:5])}")
    return read


def _on_shared_expert_ranks(name: str, modules: dict) -> bool:
    """A shared-expert tensor that this rank does not hold: with --shared-expert-ranks only those ranks do."""
    m = _SHARED_EXPERT.match(name)
    block = modules.get(m.group(1)) if m else None
    return getattr(block, "shared_remote", False) and block.shared_experts is None


def _takes_fp8(name: str, modules: dict, expert_modules: dict) -> bool:
    """Whether checkpoint weight `name` goes into an FP8 layer (which keeps it FP8)."""
    if (em := _EXPERT.match(name)) and em.group(1) in expert_modules:
        return "weight_scale_inv" in expert_modules[em.group(1)].CHECKPOINT_LEAVES
    owner, _, leaf = name.rpartition(".")
    method = getattr(modules.get(owner), "quant_method", None)
    return leaf == "weight" and getattr(method, "takes_fp8", False)


def _quant_call(fn, *args) -> list[str]:
    try:
        return fn(*args)
    except ValueError as e:  # layer-level load errors name the tensor; report them as checkpoint errors
        raise CheckpointError(str(e)) from e


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if src.dtype == torch.int8 and dst.dtype != torch.int8:
        raise CheckpointError(f"tensor {name} is INT8 (a quantized checkpoint); load it with --quantization a8w8")
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _load_expert(experts: FusedExperts, prefix: str, expert: int, proj: str, tensor: torch.Tensor,
                 loaded: set[str], leaf: str = "weight") -> None:
    name = f"{prefix}.{expert}.{proj}.{leaf}"
    tensor = experts.shard(proj, tensor, leaf)
    for slot in experts.slots_of(expert):
        filled = _quant_call(experts.load_expert, slot, proj, leaf, tensor, name)
        loaded.update(f"{prefix}.{expert}.{proj}.{f}" for f in filled)


def _check_complete(model, params, expert_modules, loaded: set[str]) -> None:
    missing = []
    for name in params:
        prefix = name.rsplit(".", 1)[0]
        if prefix in expert_modules:
            continue
        if name.startswith("lm_head.") and model.arch.tie_word_embeddings:  # filled from the embeddings
            continue
        if name not in loaded:
            missing.append(name)
    for prefix, experts in expert_modules.items():
        leaves = experts.CHECKPOINT_LEAVES
        for expert in experts.held_experts() - _supplied(prefix):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                missing.extend(n for leaf in leaves if (n := f"{prefix}.{expert}.{proj}.{leaf}") not in loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"the checkpoint is missing tensor(s): {shown}")
