"""Shared pieces of the benchmarks: machine measurements, and the bench model (moeserve/bench_model.py)."""
from __future__ import annotations

import time

import torch

# The bench model lives in the package (the planner's CPU check runs it from an installed wheel too).
from moeserve.bench_model import BENCH_CONFIG, bench_checkpoint  # noqa: F401  (re-exported for benchmarks/)


def param_counts(config: dict) -> dict[str, float]:
    """Total and per-token-active parameter counts of a DeepSeek-V3-style config."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    attn = (h * config["q_lora_rank"] + config["q_lora_rank"] * heads * qk
            + h * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
            + config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
            + heads * config["v_head_dim"] * h)
    expert = 3 * h * config["moe_intermediate_size"]
    dense = 3 * h * config["intermediate_size"]
    n_moe = config["num_hidden_layers"] - config["first_k_dense_replace"]
    embed = config["vocab_size"] * h
    total = (config["num_hidden_layers"] * attn + config["first_k_dense_replace"] * dense
             + n_moe * (config["n_routed_experts"] + config["n_shared_experts"]) * expert + 2 * embed)
    active = (config["num_hidden_layers"] * attn + config["first_k_dense_replace"] * dense
              + n_moe * (config["num_experts_per_tok"] + config["n_shared_experts"]) * expert + embed)
    return {"total": total, "active": active}


def memory_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth: best of `repeats` passes summing a large float32 buffer (GB/s).

    float32 sum is memory-bound here; a BF16 sum is not (it converts every element)."""
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9
