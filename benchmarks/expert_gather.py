"""Decode with the routed experts traced into the decode graphs (gathered: one matrix-vector product per
(token, expert) pair) against the per-expert GEMMs in an opaque op, on benchmarks/decode_speed.py's
V3-shaped checkpoint.

Usage: python benchmarks/expert_gather.py [--mode a8w8|bf16] [--batches 1 2 4 8] [--limits 0 0.5]
           [--repeats 3] [--new-tokens 33]

One engine per limit, in pairs per expert slot (0: never gather): `Int8FusedExperts.GATHER_PAIRS_PER_SLOT`
for A8W8, `FusedExperts.GATHER_ROWS_PER_SLOT` for BF16 (its rows are the pairs), all in this process,
alternated per repeat; decode tok/s as decode_speed.py times it (this thread's CPU time, one thread), the
median per engine with every repeat, and each engine's ratio to the first. The engines are built in the
order given: swap it (and give the same value twice) to see how much the build order alone moves a ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.decode_speed import decode_tps, engine_kwargs, v3_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["a8w8", "bf16"], default="a8w8")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--limits", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from moeserve import LLM
    from moeserve.layers.moe.experts import FusedExperts
    from moeserve.layers.quant import Int8FusedExperts

    owner, attr = ((Int8FusedExperts, "GATHER_PAIRS_PER_SLOT") if args.mode == "a8w8"
                   else (FusedExperts, "GATHER_ROWS_PER_SLOT"))
    kw = engine_kwargs(args.mode, argparse.Namespace(batches=args.batches, prefill_prompts=1,
                                                  prompt_len=args.prompt_len, tensor_parallel_size=1))
    engines = []
    for limit in args.limits:  # read when the graphs are traced, at engine start
        setattr(owner, attr, limit)
        engines.append((limit, LLM(v3_checkpoint(), **kw)))
    for _, llm in engines:  # warm-up: every batch size once
        for b in args.batches:
            decode_tps(llm, b, args.prompt_len, 4, salt=0)
    for b in args.batches:
        runs = [[] for _ in engines]
        for r in range(args.repeats):
            for i, (_, llm) in enumerate(engines):
                runs[i].append(decode_tps(llm, b, args.prompt_len, args.new_tokens, salt=r + 1))
        base = statistics.median(runs[0])
        print(f"batch {b:3d}: " + "  ".join(
            f"limit {limit}: {statistics.median(rs):.1f} tok/s x{statistics.median(rs) / base:.3f} "
            f"{[round(x, 1) for x in rs]}" for (limit, _), rs in zip(engines, runs)), flush=True)


if __name__ == "__main__":
    main()
