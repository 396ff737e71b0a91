"""Tokenizer loading from the checkpoint folder (Hugging Face tokenizer files)."""
from __future__ import annotations

import os


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    config = _transformers_config(path)
    try:
        return AutoTokenizer.from_pretrained(path, **({"config": config} if config is not None else {}))
    except Exception as e:  # transformers raises several types for a missing/broken tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r} ({_one_line(e)}); pass --tokenizer PATH") from e


def _transformers_config(path: str):
    """transformers' reading of path/config.json, which AutoTokenizer would otherwise do itself.

    Read apart so that a config.json transformers rejects (a YaRN rope_scaling without `factor`, say) is
    reported as such, not as a missing tokenizer. None: no config.json (a tokenizer-only folder).
    """
    from transformers import AutoConfig, PretrainedConfig

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    try:
        try:
            return AutoConfig.from_pretrained(path)
        except (ValueError, OSError):  # a model type transformers lacks: AutoTokenizer's own fallback
            return PretrainedConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"transformers cannot read {cfg_path} ({type(e).__name__}: {_one_line(e)}), so neither can "
                         f"the tokenizer loader; fix the file") from e


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())  # transformers' messages span lines; ours are one


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
