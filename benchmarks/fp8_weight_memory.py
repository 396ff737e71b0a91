"""Weight memory of DeepSeek-V3 (the published config.json's shapes) as moeserve holds it: BF16, a8w8 and
block FP8. Built on the meta device, so nothing is allocated; bytes are exact parameter sizes.

    python benchmarks/fp8_weight_memory.py
"""
from __future__ import annotations

import torch

from moeserve.config import QuantConfig
from moeserve.arch import DeepseekArch
from moeserve.models.quantization import apply_quantization
from moeserve.models.registry import MODEL_CLASSES, _default_dtype

# DeepSeek-V3's config.json (the fields moeserve reads), MTP layer not counted
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False,
    model_type="deepseek_v3",
)


def weight_bytes(method: str | None) -> tuple[int, int, dict[torch.dtype, int]]:
    arch = DeepseekArch.from_dict(DEEPSEEK_V3)
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        model = MODEL_CLASSES[arch.architecture](arch, 4096)
        apply_quantization(model, QuantConfig(method=method))
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    params = sum(p.numel() for n, p in model.named_parameters() if "scale" not in n)
    return sum(by_dtype.values()), params, by_dtype


def main() -> None:
    base = None
    print("| weights | total GiB | bytes per parameter | by dtype (GiB) |\n|---|---|---|---|")
    for method in (None, "a8w8", "fp8"):
        total, params, by_dtype = weight_bytes(method)
        base = base or total
        parts = ", ".join(f"{str(d).replace('torch.', '')} {b / 2**30:.1f}" for d, b in by_dtype.items())
        print(f"| {method or 'bf16'} | {total / 2**30:.1f} | {total / params:.3f} | {parts} |")
    print(f"(parameters without scales: {params / 1e9:.1f} B)")


if __name__ == "__main__":
    main()
