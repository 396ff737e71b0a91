"""EngineArgs -> EngineConfig with the checkpoint looked at: where the engine is built (LLM, `moeserve serve`).

config.py stays plain data; the lookups that need models/ (the bundled model's folder, the quantization a
checkpoint's config.json implies) happen here, so config, distributed, layers and models import in one
direction.
"""
from __future__ import annotations

from moeserve.config import EngineConfig

from moeserve.engine_args import EngineArgs
from moeserve.models.quantization import resolve_quant_config
from moeserve.models.registry import resolve_model_path


def resolve_engine_config(args: EngineArgs, model_max_len: int) -> EngineConfig:
    """Resolve args.model in place (None: the bundled model) and build the config for that checkpoint."""
    args.model = resolve_model_path(args.model)
    return args.create_config(model_max_len, quant=resolve_quant_config(args.quantization, args.model))
