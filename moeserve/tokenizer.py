"""Tokenizer loading from the checkpoint folder (Hugging Face tokenizer files)."""
from __future__ import annotations


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises several types for a missing/broken tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r} ({e}); pass --tokenizer PATH") from e


def eos_token_ids(tokenizer, arch_eos: tuple[int, ...], generation_config: dict | None = None) -> list[int]:
    """EOS ids: generation_config.json first (what HF generate uses), then config.json, then the tokenizer."""
    ids: list[int] = []
    gen_eos = (generation_config or {}).get("eos_token_id")
    if gen_eos is not None:
        ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    elif arch_eos:
        ids = list(arch_eos)
    elif tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids
