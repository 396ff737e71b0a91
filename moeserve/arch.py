"""DeepseekArch: the architecture read from a checkpoint's config.json (DeepseekV3/V2 family). Its own module below
layers/ and models/, so layers read the architecture without importing the model package."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


class UnsupportedModelError(ValueError):
    pass


# Keys from_dict reads with no default: without them the model's shapes are unknown.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# YaRN keys the rotary embedding reads as numbers (layers/rotary.py); `factor` is required.
_YARN_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim", "attention_factor")


@dataclass(frozen=True)
class DeepseekArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int | None
    n_shared_experts: int | None
    num_experts_per_tok: int | None
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    max_position_embeddings: int
    rms_norm_eps: float
    rope: dict = field(hash=False)  # normalised: rope_type, rope_theta, factor, mscale, ...
    rope_interleave: bool
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int
    quantization_config: dict | None = field(default=None, hash=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token and layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "DeepseekArch":
        """source: the file cfg came from, for error messages."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: moeserve runs "
                f"{' and '.join(SUPPORTED_ARCHITECTURES)} checkpoints")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        missing = [k for k in REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"{source} is missing required key(s) {', '.join(missing)} "
                                        f"(a {arch} config.json sets them)")
        v3 = arch == "DeepseekV3ForCausalLM"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
            q_lora_rank=cfg.get("q_lora_rank"), qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            n_routed_experts=cfg.get("n_routed_experts"), n_shared_experts=cfg.get("n_shared_experts"),
            num_experts_per_tok=cfg.get("num_experts_per_tok"),
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            moe_layer_freq=cfg.get("moe_layer_freq") or 1,
            n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            topk_method=cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=normalize_rope(cfg, source),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
            quantization_config=cfg.get("quantization_config"),
        )._validated()

    def _validated(self) -> "DeepseekArch":
        if self.n_routed_experts:
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise UnsupportedModelError(f"topk_method {self.topk_method!r} is not supported")
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise UnsupportedModelError(f"scoring_func {self.scoring_func!r} is not supported")
            if self.topk_method != "greedy" and (not self.n_group or self.n_routed_experts % self.n_group):
                raise UnsupportedModelError(
                    f"n_routed_experts {self.n_routed_experts} must divide into n_group {self.n_group}")
        return self

    @classmethod
    def from_pretrained(cls, path: str) -> "DeepseekArch":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{path!r} is not a checkpoint folder: it has no config.json")
        with open(cfg_path) as f:
            try:
                return cls.from_dict(json.load(f), cfg_path)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e


def normalize_rope(cfg: dict, source: str = "config.json") -> dict:
    """One rope dict from either the transformers-5 `rope_parameters` or the classic `rope_scaling`.

    Checked here, so that a bad entry is reported against the file, not as a KeyError when the model is built.
    """
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ("default", "yarn"):
        raise UnsupportedModelError(f"{source}: rope type {rope['rope_type']!r} is not supported (default, yarn)")
    if not _is_number(rope["rope_theta"]) or rope["rope_theta"] <= 0:
        raise UnsupportedModelError(f"{source}: rope_theta must be a positive number, not {rope['rope_theta']!r}")
    if rope["rope_type"] == "yarn":
        if rope.get("factor") is None:
            raise UnsupportedModelError(f"{source}: {key} of type 'yarn' has no 'factor' (the context extension, "
                                        f"e.g. 40 for DeepSeek-V3); add it")
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
        bad = [f"{k}={rope[k]!r}" for k in _YARN_NUMBERS if rope.get(k) is not None and not _is_number(rope[k])]
        if bad:
            raise UnsupportedModelError(f"{source}: {key} values must be numbers: {', '.join(bad)}")
        if rope["factor"] <= 0 or rope["original_max_position_embeddings"] <= 0:
            raise UnsupportedModelError(f"{source}: {key} factor and original_max_position_embeddings must be "
                                        f"positive (got {rope['factor']!r}, "
                                        f"{rope['original_max_position_embeddings']!r})")
    return rope


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
