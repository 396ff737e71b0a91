"""Shared pieces of the benchmarks: the bench checkpoint and machine measurements."""
from __future__ import annotations

import os
import time

import torch

# The core engine's bench config (~475M parameters): hidden 1024, 8 layers (first dense), 64 routed experts
# top-6, 2 shared, moe_intermediate 256, q_lora 384, kv_lora 256, 16 heads, vocab 32000.
BENCH_CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
    n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1,
)


def bench_checkpoint(path: str | None = None, config: dict | None = None, seed: int = 0) -> str:
    """Write (once) a random BF16 checkpoint of the bench config with transformers; returns its folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = config or BENCH_CONFIG
    path = path or os.path.join(os.environ.get("MOESERVE_CACHE", os.path.expanduser("~/.cache/moeserve")),
                                f"bench-{config['hidden_size']}h-{config['num_hidden_layers']}l")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).to(torch.bfloat16)
        model.save_pretrained(path)
        from moeserve.models.default import _train_tokenizer
        _train_tokenizer(512).save_pretrained(path)
    return path


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
