"""Benchmark prompts: random token sequences of a given length, or ShareGPT conversations.

Sampling follows `vllm bench serve` so figures are comparable: random prompts have input lengths drawn
uniformly from [L*(1-r), L*(1+r)] (the same for outputs), after a shared prefix of --random-prefix-len
random tokens when one is asked for; ShareGPT takes the first human turn as the prompt
and the length of the first reply as the output length, skipping pairs with fewer than 4 tokens on a side,
prompts over 1024 tokens and pairs over 2048 tokens.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, prefix_len: int = 0) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]
    out = []
    for in_len, out_len in zip(_lengths(rng, input_len, range_ratio, num),
                               _lengths(rng, output_len, range_ratio, num)):
        in_len += prefix_len
        ids = prefix + [rng.choice(vocab) for _ in range(in_len - prefix_len)]
        text = tokenizer.decode(ids)
        # Re-tokenizing decoded text drifts a little; trim or pad so the prompt has in_len tokens.
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) != in_len:
            enc = (enc + ids)[:in_len]
            text = tokenizer.decode(enc)
        out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), out_len))
    return out


def sharegpt_requests(path: str, tokenizer, num: int, output_len: int | None, seed: int) -> list[SampleRequest]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r} is not a readable ShareGPT JSON file ({e})") from None
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < num:
        raise ValueError(f"{path} has only {len(out)} usable conversations; lower --num-prompts")
    return out
