"""Which model class runs a checkpoint, how it is built and where the default model lives."""
from __future__ import annotations

import contextlib
import os

import torch

from moeserve.config import QuantConfig
from moeserve.models.config import DeepseekArch
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
                quant: QuantConfig | None = None, keep_mtp: bool = False) -> tuple[torch.nn.Module, LoadedCheckpoint]:
    """Construct without initialising (meta device), quantize the layout, allocate, fill from the checkpoint.

    keep_mtp: also read the MTP layer's tensors (checkpoint.mtp_weights), for speculative decoding.
    """
    cls = MODEL_CLASSES[arch.architecture]
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(arch, max_positions)
        apply_quantization(model, quant or QuantConfig())
    model.to_empty(device="cpu")
    checkpoint = load_weights(model, path, keep_mtp)
    model.process_weights_after_loading()
    model.eval()
    return model, checkpoint
