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
    # Top-1 routing: V3 renormalises the single weight to 1 (norm_topk_prob defaults to true), V2 does not
    "v3_top1": dict(arch="v3", num_experts_per_tok=1),
    "v2_top1": dict(arch="v2", num_experts_per_tok=1, norm_topk_prob=True),
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


MTP_BLOCK_SCALE = 0.3


def mtp_hf_block(variant: str = "v3", seed: int = 0, **overrides):
    """(HF model, L): layer L of an (L+1)-layer random model (seed + 1) is the test MTP layer's block.

    Its attention and MoE outputs are scaled down so that, with an eh_proj that passes the main hidden state
    through, the drafts agree with the main model sometimes but not always (tests see both outcomes).
    """
    spec = {**BASE, **VARIANTS[variant], **overrides}
    layers = spec["num_hidden_layers"]
    model = hf_model(variant, seed + 1, **{**overrides, "num_hidden_layers": layers + 1})
    block = model.model.layers[layers]
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(MTP_BLOCK_SCALE)
        block.mlp.experts.down_proj.mul_(MTP_BLOCK_SCALE)
        block.mlp.shared_experts.down_proj.weight.mul_(MTP_BLOCK_SCALE)
    return model, layers


def mtp_tensors(variant: str = "v3", seed: int = 0, **overrides) -> dict:
    """model.layers.{L}.* tensors of the test MTP layer, named as DeepSeek-V3 ships them."""
    import tempfile

    from safetensors.torch import load_file

    model, layers = mtp_hf_block(variant, seed, **overrides)
    h = model.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        on_disk = load_file(os.path.join(tmp, "model.safetensors"))
    prefix = f"model.layers.{layers}."
    out = {k: v for k, v in on_disk.items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(seed + 2)
    out[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    out[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    # [H, 2H] acting on [enorm(embedding) ; hnorm(main hidden)]
    out[prefix + "eh_proj.weight"] = torch.cat([0.05 * torch.randn(h, h, generator=g), torch.eye(h)], dim=1)
    out[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return out


def write_mtp_checkpoint(path: str, variant: str = "v3", seed: int = 0, with_head: bool = False,
                         **overrides) -> str:
    """A test checkpoint with an MTP layer (transformers' save_pretrained writes none: we add it)."""
    import json

    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tmp = path + f".tmp{os.getpid()}"
    write_checkpoint(tmp, variant, seed, **overrides)
    f = os.path.join(tmp, "model.safetensors")
    tensors = load_file(f)
    mtp = mtp_tensors(variant, seed, **overrides)
    if with_head:  # DeepSeek-V3 repeats the shared head and embedding inside its MTP layer
        layers = {**BASE, **overrides}["num_hidden_layers"]
        prefix = f"model.layers.{layers}."
        mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update(mtp)
    save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["num_nextn_predict_layers"] = 1
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    os.rename(tmp, path)
    return path


NAN_TOKEN = 7  # write_nan_token_checkpoint: the token whose embedding is NaN


def write_nan_token_checkpoint(path: str, variant: str = "v3") -> str:
    """The tiny checkpoint with token NAN_TOKEN's embedding row NaN: a prompt holding it gets non-finite
    logits from the model itself (what no request validation can prevent), any other prompt is unchanged."""
    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tmp = path + f".tmp{os.getpid()}"
    write_checkpoint(tmp, variant)
    f = os.path.join(tmp, "model.safetensors")
    tensors = load_file(f)
    tensors["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    os.replace(tmp, path)
    return path
