"""Default sampling parameters from the checkpoint's generation_config.json (vLLM's --generation-config).

Model authors put their recommended sampling there (DeepSeek-R1: temperature 0.6, top_p 0.95). With "auto"
(the default) requests that leave a field unset get it from there, offline and over HTTP; "vllm" ignores the
file (SamplingParams' own defaults); a folder path reads that folder's generation_config.json instead.
As in vLLM, `do_sample` is not read: a request is greedy only when its temperature is 0.
"""
from __future__ import annotations

import json
import os

# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(folder: str) -> dict | None:
    """The folder's generation_config.json, or None when it has none."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); fix it or pass --generation-config vllm") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; fix it or pass --generation-config vllm")
    return data


def default_sampling(generation_config: str, model_path: str) -> dict:
    """The SamplingParams fields the checkpoint recommends ({} with "vllm" or no file), checked."""
    from moeserve.sampling_params import SamplingParams, SamplingParamsError

    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isdir(folder):
        raise ValueError(f"--generation-config must be auto, vllm or a folder with generation_config.json; "
                         f"{generation_config!r} is none of these")
    data = read_generation_config(folder) or {}
    out = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**out)
    except SamplingParamsError as e:
        raise ValueError(f"{os.path.join(folder, 'generation_config.json')}: {e}; fix it or pass "
                         "--generation-config vllm") from None
    return out
