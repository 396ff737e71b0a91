"""Which model class runs a checkpoint, how it is built and where the default model lives."""
from __future__ import annotations

import contextlib
import os

import torch

from moeserve.config import QuantConfig
from moeserve.device_memory import check_fits, module_bytes
from moeserve.arch import DeepseekArch
from moeserve.models.deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from moeserve.models.loader import LoadedCheckpoint, load_weights
from moeserve.models.quantization import apply_quantization

MODEL_CLASSES = {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM, "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM}


def resolve_model_path(model: str | None) -> str:
    """A checkpoint folder; None means the model bundled with moeserve."""
    if model is None:
        from moeserve.models.default import default_model_path
        return default_model_path()
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model {model!r} is not a local checkpoint folder (moeserve does not download)")
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(path: str, arch: DeepseekArch, dtype: torch.dtype, max_positions: int,
                quant: QuantConfig | None = None, keep_mtp: bool = False,
                load_format: str = "auto") -> tuple[torch.nn.Module, LoadedCheckpoint]:
    """Construct without initialising (meta device), quantize the layout, allocate, fill from the checkpoint.

    keep_mtp: also read the MTP layer's tensors (checkpoint.mtp_weights), for speculative decoding.
    load_format "dummy" (vLLM's): random weights of the checkpoint's shapes, no tensor read (benchmarks of a
    model one has only the config.json of).
    """
    if load_format == "dummy" and keep_mtp:
        raise ValueError("--load-format dummy has no MTP layer weights; drop --speculative-config")
    cls = MODEL_CLASSES[arch.architecture]
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(arch, max_positions)
        apply_quantization(model, quant or QuantConfig())
    check_fits(module_bytes(model), torch.device("cpu"), f"the weights ({arch.architecture}, {dtype})",
               "use a smaller --dtype, --quantization a8w8 or fp8, or more ranks (--tensor-parallel-size / "
               "--data-parallel-size with --enable-expert-parallel)")
    model.to_empty(device="cpu")
    checkpoint = dummy_weights(model) if load_format == "dummy" else load_weights(model, path, keep_mtp)
    model.process_weights_after_loading()
    model.eval()
    return model, checkpoint


def dummy_weights(model: torch.nn.Module, seed: int = 0) -> LoadedCheckpoint:
    """Small random values in every parameter (floats in [-1e-3, 1e-3] as vLLM's dummy loader, int8 in
    [-8, 8]): finite, so the forward runs as with real weights; the output is noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.rand(p.shape, generator=gen) * 2e-3 - 1e-3)
            else:
                p.copy_(torch.randint(-8, 9, p.shape, generator=gen, dtype=p.dtype))
    return LoadedCheckpoint()
