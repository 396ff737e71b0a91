"""Tiny random DeepseekV3/V2 checkpoints written with transformers' save_pretrained (the test oracle)."""
from __future__ import annotations

import functools
import os

import torch

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    n_group=2, topk_group=1,
)

VARIANTS = {
    # V3: sigmoid + e_score_correction_bias, noaux_tc group-limited routing
    "v3": dict(arch="v3"),
    # V3 with YaRN long-context rope (factor, mscale, mscale_all_dim as DeepSeek-V3 ships)
    "v3_yarn": dict(arch="v3", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 128, "beta_fast": 32,
                                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # V3 without interleaved rope, 4 groups choose 2
    "v3_nointerleave": dict(arch="v3", rope_interleave=False, n_routed_experts=8, n_group=4, topk_group=2),
    # V2-Lite shape: no q_lora_rank, softmax greedy routing
    "v2_lite": dict(arch="v2", q_lora_rank=None, topk_method="greedy"),
    # V2 with group-limited greedy routing
    "v2_group": dict(arch="v2", topk_method="group_limited_greedy", n_group=4, topk_group=2),
}


@functools.lru_cache(maxsize=1)
def tokenizer():
    from moeserve.models.default import _train_tokenizer
    return _train_tokenizer(BASE["vocab_size"])


def hf_model(variant: str, seed: int = 0, **overrides):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    spec = {**BASE, **VARIANTS[variant], **overrides}
    arch = spec.pop("arch")
    torch.manual_seed(seed)
    if arch == "v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**spec))
        # Non-zero correction bias so the test sees it steer choice but not weights.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.1)
    else:
        spec.pop("rope_interleave", None)
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**spec))
    # Larger weights than the HF init (0.02) so that logits are peaked and greedy choices are not ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "gate.weight" not in name:
                p.normal_(0, 0.08)
    return model.eval()


def write_checkpoint(path: str, variant: str = "v3", seed: int = 0, **overrides) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        model = hf_model(variant, seed, **overrides)
        model.save_pretrained(path)
        tokenizer().save_pretrained(path)
    return path
