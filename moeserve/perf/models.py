"""Model shapes for the planner: presets or any DeepSeek-V2/V3 Hugging Face config.json.

Parameter counts are exact sums of the linear weights (norms and biases are < 0.01% and left out);
tests check them against ../shared/reference/hardware.md (187.1M attention/layer, 44.04M/expert, 671.0B).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path

import yaml

from moeserve.files import read_text

_FIELDS = ("hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size",
           "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
           "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_attention_heads: int
    vocab_size: int
    num_nextn_predict_layers: int = 0
    moe_layer_freq: int = 1
    max_position_embeddings: int | None = None  # context window (prompt + output); None: not stated
    # Group-limited routing (DeepSeek-V3: 8 groups, top-4): a token's experts lie in topk_group of n_group
    # expert groups, which bounds the nodes it is sent to (moe.nodes_per_token). 1 / 1: no limit.
    n_group: int = 1
    topk_group: int = 1
    # Busiest expert rank's load over the mean beyond sampling noise under EPLB, as published for this model
    # (data/models.yaml `eplb_residual_imbalance`; docs/planner.md "Expert load"); 1.0: none published.
    residual_imbalance: float = 1.0

    def __post_init__(self):
        if self.n_routed_experts and self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"{self.name}: top-k {self.num_experts_per_tok} > {self.n_routed_experts} experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.name}: topk_group {self.topk_group} must be in [1, n_group {self.n_group}]")
        if not 1.0 <= self.residual_imbalance <= 1e9:
            raise ValueError(f"{self.name}: eplb_residual_imbalance is max/mean rank load, in [1, 1e9]; "
                             f"got {self.residual_imbalance}")

    # ---- layer counts (cached: the simulator prices hundreds of thousands of steps)
    @cached_property
    def num_moe_layers(self) -> int:
        if not self.n_routed_experts:
            return 0
        # i in [first_k_dense_replace, num_hidden_layers) with i % moe_layer_freq == 0, counted without a
        # loop over the layers (num_hidden_layers 1e30 in a --model config never returned)
        f, lo = self.moe_layer_freq, self.first_k_dense_replace
        return max(0, (self.num_hidden_layers - 1) // f - (lo - 1) // f) if lo < self.num_hidden_layers else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    # ---- parameter counts (elements)
    @property
    def q_a_params(self) -> int:  # replicated under attention TP
        return self.hidden_size * self.q_lora_rank if self.q_lora_rank else 0

    @property
    def kv_a_params(self) -> int:  # replicated under attention TP
        return self.hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def attn_split_params(self) -> int:
        """q_b (or q), kv_b and o_proj: the parts attention TP splits by head."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q_in = self.q_lora_rank or self.hidden_size
        h = self.num_attention_heads
        return (q_in * h * qk + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
                + h * self.v_head_dim * self.hidden_size)

    @property
    def attn_params(self) -> int:
        return self.q_a_params + self.kv_a_params + self.attn_split_params

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size  # gate, up, down

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def gate_params(self) -> int:
        return self.hidden_size * self.n_routed_experts

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size  # lm_head has the same count

    @property
    def moe_layer_params(self) -> int:
        n = self.n_routed_experts + self.n_shared_experts
        return self.attn_params + n * self.expert_params + self.gate_params

    @property
    def dense_layer_params(self) -> int:
        return self.attn_params + self.dense_mlp_params

    @property
    def total_params(self) -> int:
        """Main model (no MTP layer), embedding and head counted separately as in HF."""
        return (self.num_dense_layers * self.dense_layer_params
                + self.num_moe_layers * self.moe_layer_params + 2 * self.embed_params)

    @property
    def mtp_layer_params(self) -> int:
        """One MTP module: eh_proj [2H -> H] plus a full decoder layer; embedding/head are shared."""
        layer = self.moe_layer_params if self.n_routed_experts else self.dense_layer_params
        return 2 * self.hidden_size * self.hidden_size + layer

    @property
    def active_params(self) -> int:
        per_moe = self.attn_params + (self.num_experts_per_tok + self.n_shared_experts) * self.expert_params
        return (self.num_dense_layers * self.dense_layer_params + self.num_moe_layers * per_moe
                + 2 * self.embed_params)

    # ---- KV cache
    @property
    def kv_elems_per_token_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim  # MLA latent + shared rope key

    def kv_bytes_per_token(self, kv_bytes: float, with_mtp: bool = False) -> float:
        layers = self.num_hidden_layers + (self.num_nextn_predict_layers if with_mtp else 0)
        return self.kv_elems_per_token_layer * kv_bytes * layers


def _preset_table() -> dict:
    text = resources.files("moeserve.perf").joinpath("data/models.yaml").read_text()
    return yaml.safe_load(text)


def preset_names() -> list[str]:
    return sorted(_preset_table())


def from_hf_config(cfg: dict, name: str = "custom", where: str | None = None) -> ModelSpec:
    """Build a spec from a HF DeepseekV2/V3 config dict (extra keys ignored); errors start with `where`
    (default: the name)."""
    where = where or name
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a config mapping, got a {type(cfg).__name__}")
    missing = [f for f in _FIELDS if f not in cfg]
    if missing:
        raise ValueError(f"{where}: config lacks {missing}; is it a DeepSeek-V2/V3 config.json?")
    kw = {f: _count(cfg, f, where, _OPTIONAL.get(f, ...)) for f in (*_FIELDS, *_OPTIONAL)}
    skew = cfg.get("eplb_residual_imbalance", 1.0)  # a planner field (data/models.yaml), not Hugging Face's
    if isinstance(skew, bool) or not isinstance(skew, (int, float)):
        raise ValueError(f"{where}: eplb_residual_imbalance must be a number, got {skew!r}")
    return ModelSpec(name=name, **kw, residual_imbalance=float(skew))


# Fields a config may leave out or null, and what that means (no routed experts, no q compression, ...).
_OPTIONAL = {"num_nextn_predict_layers": 0, "moe_layer_freq": 1, "n_shared_experts": 0, "n_routed_experts": 0,
             "q_lora_rank": None, "max_position_embeddings": None, "n_group": 1, "topk_group": 1}
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_layer_freq",
             "max_position_embeddings", "n_group", "topk_group")


def _count(cfg: dict, field: str, where: str, default=...):
    """cfg[field] as a non-negative int (positive where zero makes no model); `default` when an optional
    field is absent or null."""
    v = cfg.get(field)
    if v is None and default is not ...:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < (1 if field in _POSITIVE else 0):
        low = "a positive" if field in _POSITIVE else "a non-negative"
        raise ValueError(f"{where}: {field} must be {low} integer, got {v!r}")
    if v > _MAX_COUNT:  # hidden_size 1e400 overflowed a float (OverflowError)
        raise ValueError(f"{where}: {field} must be <= {_MAX_COUNT} (2^31 - 1), got {v}")
    return v


_MAX_COUNT = 2 ** 31 - 1


def check_context(m: ModelSpec, input_len: int, output_len: int | None, names: tuple[str, ...]) -> None:
    """The prompt (plus the output when generating; None: a prefill, which never generates) must fit the
    model's context window when its config states one. `names`: what the user set the lengths with
    (flags, or a cases file's fields)."""
    limit = m.max_position_embeddings
    if limit is None:
        return
    if output_len is None:
        if input_len > limit:
            raise ValueError(f"{names[0]} {input_len} exceeds {m.name}'s context window of {limit} tokens "
                             "(max_position_embeddings); use a shorter prompt")
    elif input_len + output_len > limit:
        raise ValueError(f"{names[0]} {input_len} + {names[1]} {output_len} = {input_len + output_len} tokens "
                         f"exceed {m.name}'s context window of {limit} (max_position_embeddings); shorten them")


@lru_cache(maxsize=None)
def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a config.json path, or a checkpoint folder holding one."""
    table = _preset_table()
    key = name_or_path.lower()
    if key in table:
        cfg = table[key]
        while "same_as" in cfg:
            cfg = table[cfg["same_as"]]
        return from_hf_config(cfg, name=key)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a preset ({', '.join(sorted(table))}) "
                         "nor a config.json / checkpoint folder")
    text = read_text(path, f"--model {path}", "a config.json")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--model {path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    return from_hf_config(cfg, name=path.parent.name or path.stem, where=f"--model {path}")
