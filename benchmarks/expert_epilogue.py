"""The routed experts' passes around their GEMMs (layers/moe/expert_epilogue.py): eager passes against the
inductor kernels, in one engine, switched between alternating repeats.

One LLM on the V3-shaped checkpoint of benchmarks/decode_speed.py (compiled decode, which switches the kernels
on); per repeat and variant: prefill tok/s of --prefill-prompts prompts of --prompt-len tokens in one step, and
decode tok/s at each --batches size (decode_speed.py's measures, thread CPU time). Printed: the medians and
the median of the per-repeat ratios kernels / eager with their range. Figures, never pass/fail.

Usage: python benchmarks/expert_epilogue.py [--modes bf16 a8w8] [--repeats 4] [--batches 8 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.decode_speed import decode_tps, engine_kwargs, prefill_tps, v3_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["bf16", "a8w8"], choices=["bf16", "a8w8"])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moeserve import LLM
    from moeserve.layers.moe import expert_epilogue

    path = v3_checkpoint()
    for mode in args.modes:
        llm = LLM(path, **engine_kwargs(mode, args))
        kernels = expert_epilogue._combine
        if kernels is None:
            sys.exit("the engine did not switch the kernels on (eager engine?)")

        def measure(on: bool, salt: int) -> dict:
            expert_epilogue._combine = kernels if on else None  # None: enabled_for() says no, eager passes
            res = {"prefill": prefill_tps(llm, args.prefill_prompts, args.prompt_len, salt)}
            for b in args.batches:
                res[f"batch {b}"] = decode_tps(llm, b, args.prompt_len, args.new_tokens, salt)
            return res

        measure(False, 0), measure(True, 0)  # warm-up
        runs = {False: [], True: []}
        for r in range(args.repeats):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                runs[on].append(measure(on, r + 1))
        expert_epilogue._combine = kernels
        for key in runs[True][0]:
            ratios = [n[key] / o[key] for o, n in zip(runs[False], runs[True])]
            print(f"{mode} {key:>9s}: eager {statistics.median(x[key] for x in runs[False]):8.1f} tok/s, kernels "
                  f"{statistics.median(x[key] for x in runs[True]):8.1f}: x{statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
        del llm


if __name__ == "__main__":
    main()
