"""The model that serves when none is named.

The trained model shipped inside the package (models/bundled/tiny-deepseek-v3) when present; otherwise a
tiny DeepSeek-V3-architecture checkpoint with deterministic random weights, written once to the user cache
and labelled as random in its folder name and model card.
"""
from __future__ import annotations

import os

BUNDLED = os.path.join(os.path.dirname(__file__), "bundled", "tiny-deepseek-v3")
RANDOM_NAME = "random-tiny-deepseek-v3"

RANDOM_CONFIG = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
    kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
)


def default_model_path() -> str:
    if os.path.isfile(os.path.join(BUNDLED, "config.json")):
        return BUNDLED
    cache = os.environ.get("MOESERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moeserve"))
    path = os.path.join(cache, RANDOM_NAME)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path)
    return path


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on a few standard-library files (always present with Python)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("textwrap.py", "string.py", "bisect.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([f for f in files if os.path.isfile(f)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>")


def write_random_checkpoint(path: str, seed: int = 0) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tmp = path + f".tmp{os.getpid()}"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**RANDOM_CONFIG)).to(torch.bfloat16)
    model.save_pretrained(tmp)
    _train_tokenizer(RANDOM_CONFIG["vocab_size"]).save_pretrained(tmp)
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write("# random-tiny-deepseek-v3\n\nRANDOM weights (seed 0): a placeholder default model for "
                "moeserve demos and tests. Its output is meaningless text.\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process wrote it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
