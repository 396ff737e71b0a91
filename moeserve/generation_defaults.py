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


def parse_override(value: "dict | str | None") -> dict:
    """--override-generation-config: a JSON object of generation_config keys (vLLM's), checked."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config must be a JSON object such as "
                             f"'{{\"temperature\": 0.5}}': {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object / dict")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(KEYS)}")
    return value


def default_sampling(generation_config: str, model_path: str, override: "dict | str | None" = None) -> dict:
    """The SamplingParams fields the checkpoint recommends ({} with "vllm" or no file), with
    --override-generation-config's keys over them (as vLLM: also with "vllm"), checked."""
    from moeserve.sampling_params import SamplingParams, SamplingParamsError

    data = parse_override(override)
    folder = model_path if generation_config == "auto" else generation_config
    if generation_config not in ("auto", "vllm") and not os.path.isdir(folder):
        raise ValueError(f"--generation-config must be auto, vllm or a folder with generation_config.json; "
                         f"{generation_config!r} is none of these")
    if generation_config != "vllm":
        data = {**(read_generation_config(folder) or {}), **data}
    out = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**out)
    except SamplingParamsError as e:
        raise ValueError(f"{os.path.join(folder, 'generation_config.json')}: {e}; fix it or pass "
                         "--generation-config vllm") from None
    return out
