"""Automatic prefix caching: prompts that share a long prefix (a system prompt, a few-shot header, earlier
turns of a chat), with the cache on and off, same model, same process.

Each round sends --requests prompts = one shared prefix of --prefix-len tokens + a distinct suffix of
--suffix-len tokens, --max-tokens out. The cache-on engine has seen the prefix once before (one earlier
request), as a server has after its first user. A second round type samples n = --requests answers to
one new prompt of --prefix-len tokens (the siblings wait a step and share the first one's prompt). Prints
the wall time per round, the prompt tokens the cache served and the speed-up (off / on); best of --repeats.
Figures, never pass/fail.

Usage: python benchmarks/prefix_cache.py [--model PATH] [--prefix-len 1024] [--suffix-len 32] [--requests 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from moeserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    prefix = [(37 * j) % 400 + 50 for j in range(a.prefix_len)]
    kw = dict(max_model_len=a.prefix_len + a.suffix_len + a.max_tokens + 16, max_num_seqs=a.requests,
              max_num_batched_tokens=2048)
    rows, nrows = {}, {}
    for label, caching in (("off", False), ("on", True)):
        llm = LLM(a.model, enable_prefix_caching=caching, **kw)
        best_n, cached_n = float("inf"), 0
        for r in range(a.repeats):  # n samples of one prompt nobody sent before
            prompt = [(r * 7919 + 13 * j) % 400 + 50 for j in range(a.prefix_len)]
            sample = SamplingParams(n=a.requests, temperature=0.8, seed=r, max_tokens=a.max_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            res = llm.generate(prompt_token_ids=[prompt], sampling_params=sample)
            best_n = min(best_n, time.perf_counter() - t0)
        cached_n = llm.engine.stats().prefix_cache_hits
        nrows[label] = (best_n, cached_n)
        llm.generate(prompt_token_ids=[prefix + [7]], sampling_params=params)  # the first user, and warm-up
        best, cached, outs = float("inf"), 0, None
        for r in range(a.repeats):
            prompts = [prefix + [(r * 1009 + i * 31 + j) % 400 + 50 for j in range(a.suffix_len)]
                       for i in range(a.requests)]
            t0 = time.perf_counter()
            res = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            best = min(best, time.perf_counter() - t0)
            cached = sum(o.num_cached_tokens for o in res)
            outs = [o.outputs[0].token_ids for o in res]
        rows[label] = (best, cached, outs)
        llm.shutdown()
    total = a.requests * (a.prefix_len + a.suffix_len)
    print(f"{a.requests} prompts x ({a.prefix_len} shared + {a.suffix_len} own) tokens, {a.max_tokens} out, "
          f"best of {a.repeats}")
    for label, (t, cached, _) in rows.items():
        print(f"cache {label:>3}: {t * 1e3:9.1f} ms per round, {cached}/{total} prompt tokens from the cache")
    print(f"speed-up (off / on): {rows['off'][0] / rows['on'][0]:.2f}x; same tokens: {rows['off'][2] == rows['on'][2]}")
    print(f"n = {a.requests} samples of one new {a.prefix_len}-token prompt, {a.max_tokens} out, best of {a.repeats}")
    for label, (t, cached) in nrows.items():
        print(f"cache {label:>3}: {t * 1e3:9.1f} ms per prompt ({cached} prompt tokens from the cache in all rounds)")
    print(f"speed-up (off / on): {nrows['off'][0] / nrows['on'][0]:.2f}x")


if __name__ == "__main__":
    main()
