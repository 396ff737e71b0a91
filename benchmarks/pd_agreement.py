"""PD vs unified greedy output on prompts neither side has seen: how many of N agree token for token.

Three engines in this process: a unified one, a prefill and a decode instance (NIXL/UCX between them). Each
prompt is fresh random tokens (no prefix-cache hit anywhere). For a dtype, per prompt: the unified engine's
greedy tokens with the prompt alone, the same with the prompt in a batch of all prompts (what a busy server
does), and PD's (prefill alone, then decode pulls the KV and computes the last prompt token itself). Counts
agreements, and the first position where answers part. Prints figures, never passes or fails.

Why answers can part: PD computes the last prompt token in a one-token step over pulled KV, a unified engine
inside the prompt's prefill; matmuls and attention of other shapes sum in another order, so logits differ in
the last bits. In float32 that is ~1e-6 and never flips an argmax here; in BF16 (8 mantissa bits) two logits
within a rounding step of each other are a tie that either path may break its own way, and from the first
parted token the continuations differ. Batching a unified engine differently parts answers the same way.

Usage: python benchmarks/pd_agreement.py [--model DIR] [--dtypes float32,bfloat16] [--prompts 50]
       [--prompt-len 8,64] [--max-tokens 32] [--seed 0] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def greedy_tokens(engine, prompts: list[list[int]], params, prefix: str, batched: bool) -> list[list[int]]:
    from moeserve.protocol import EngineCoreRequest

    out: dict[str, list[int]] = {}
    groups = [list(enumerate(prompts))] if batched else [[(i, p)] for i, p in enumerate(prompts)]
    for group in groups:
        for i, p in group:
            engine.add_request(EngineCoreRequest(f"{prefix}{i}", p, params, []))
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"{prefix}{i}"] for i in range(len(prompts))]


def pd_tokens(prefill, decode, prompts, params, one, secret: str, prefix: str) -> list[list[int]]:
    from moeserve.disagg import trust
    from moeserve.protocol import EngineCoreRequest

    answers = []
    for i, p in enumerate(prompts):  # one at a time, as greedy_tokens(batched=False)
        prefill.add_request(EngineCoreRequest(f"{prefix}p{i}", p, one, [], kv_transfer_params=trust.ticket(secret)))
        kv = None
        while prefill.has_unfinished():
            kv = next((o.kv_transfer_params for o in prefill.step() if o.kv_transfer_params), kv)
        decode.add_request(EngineCoreRequest(f"{prefix}d{i}", p, params, [], kv_transfer_params=kv))
        toks: list[int] = []
        while decode.has_unfinished():
            for o in decode.step():
                assert o.error is None, o.error
                toks.extend(o.new_token_ids)
        answers.append(toks)
    return answers


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def measure(model: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from moeserve import LLM, SamplingParams

    secret = secrets.token_hex(16)
    kw = dict(dtype=dtype, max_model_len=max(map(len, prompts)) + max_tokens + 8, max_num_seqs=len(prompts))
    nixl = {"kv_connector": "nixl", "kv_secret": secret}
    unified = LLM(model, **kw).engine
    prefill = LLM(model, kv_transfer_config={**nixl, "kv_role": "kv_producer"}, **kw).engine
    decode = LLM(model, kv_transfer_config={**nixl, "kv_role": "kv_consumer"}, **kw).engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    alone = greedy_tokens(unified, prompts, params, "a", batched=False)
    batched = greedy_tokens(unified, prompts, params, "b", batched=True)
    pd = pd_tokens(prefill, decode, prompts, params, one, secret, "pd")
    row = {"dtype": dtype, "prompts": len(prompts), "max_tokens": max_tokens}
    for name, other in (("pd_vs_unified", pd), ("unified_batched_vs_alone", batched)):
        diffs = [first_difference(a, o) for a, o in zip(alone, other)]
        row[name] = sum(d is None for d in diffs)
        row[name + "_first_diff_positions"] = sorted(d for d in diffs if d is not None)
    return row


def main() -> None:
    from moeserve.models.default import default_model_path

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-len", default="8,64", help="prompt lengths are drawn from MIN,MAX")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = a.model or default_model_path()
    from moeserve.arch import DeepseekArch
    vocab = DeepseekArch.from_pretrained(model).vocab_size
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(a.prompts)]
    rows = [measure(model, d, prompts, a.max_tokens) for d in a.dtypes.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"model {model}; {a.prompts} random prompts of {lo}-{hi} tokens, greedy {a.max_tokens} tokens, seed {a.seed}")
    print(f"{'dtype':>9} {'PD == unified':>14} {'unified batched == alone':>25}  first parted token (PD)")
    for r in rows:
        print(f"{r['dtype']:>9} {r['pd_vs_unified']:>8}/{r['prompts']:<5} {r['unified_batched_vs_alone']:>19}/"
              f"{r['prompts']:<5} {r['pd_vs_unified_first_diff_positions']}")


if __name__ == "__main__":
    main()
