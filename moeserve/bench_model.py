"""The bench model: a random DeepSeek-V3-style checkpoint that benchmarks/ and `moeserve plan profile-cpu
--measure` run the engine on. In the package (not benchmarks/, which the wheel does not ship) so the planner's
CPU check works from an installed wheel anywhere."""
from __future__ import annotations

import os

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
    """Write (once) a random BF16 checkpoint of the bench config with transformers; returns its folder
    (default: under $MOESERVE_CACHE, else ~/.cache/moeserve)."""
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
