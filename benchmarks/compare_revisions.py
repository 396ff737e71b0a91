"""Decode (or prefill) speed of this tree against another git revision: fresh processes, alternated.

Usage: python benchmarks/compare_revisions.py --base REV [--modes bf16 a8w8] [--batches 1] [--rounds 3]
           [--repeats 5] [--new-tokens 65] [--prefill]

For a change whose before and after cannot live in one process (how ops are registered, what a graph
traces): REV is exported with `git archive` into a temporary directory, and each round starts one process
per (mode, batch, tree), the base tree first in odd rounds and last in even ones, on
benchmarks/decode_speed.py's V3-shaped checkpoint. Each process builds one engine, warms it up and times
decode as decode_speed.py does (this thread's CPU time, one thread, --repeats runs of --new-tokens after a
128-token prompt), or with --prefill its prefill (--repeats prefills of `batch` new 128-token prompts,
prompt tokens per second); it prints the median and every run.
The summary gives each round's ratio this tree / base: process-to-process spread on a quiet machine is a
few percent, so read a change smaller than that across rounds as none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import argparse, json, statistics, sys
tree, mode, batch, repeats, new_tokens, prefill = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                   int(sys.argv[5]), sys.argv[6] == "1")
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
import moeserve
assert moeserve.__file__.startswith(tree), moeserve.__file__
from benchmarks.decode_speed import decode_tps, engine_kwargs, prefill_tps, v3_checkpoint
from moeserve import LLM
llm = LLM(v3_checkpoint(), **engine_kwargs(mode, argparse.Namespace(batches=[batch], prefill_prompts=batch,
                                                                   prompt_len=128, tensor_parallel_size=1)))
if prefill:
    prefill_tps(llm, batch, 128, 0)
    runs = [prefill_tps(llm, batch, 128, r + 1) for r in range(repeats)]  # new prompts each time: no cache hit
else:
    decode_tps(llm, batch, 128, 8, 0)
    runs = [decode_tps(llm, batch, 128, new_tokens, r + 1) for r in range(repeats)]
print("RESULT " + json.dumps([x for x in runs if x == x]), flush=True)
"""


def run_child(tree: str, mode: str, batch: int, args) -> list[float]:
    out = subprocess.run([sys.executable, "-c", CHILD, tree, mode, str(batch), str(args.repeats),
                          str(args.new_tokens), str(int(args.prefill))], capture_output=True, text=True, cwd=tree)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{tree} {mode} batch {batch} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD~1)")
    ap.add_argument("--modes", nargs="+", default=["bf16", "a8w8"], choices=["bf16", "a8w8", "bf16-eager", "a8w8-eager"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--prefill", action="store_true",
                    help="time prefill instead of decode: each batch is the number of 128-token prompts a step takes")
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=HERE, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="moeserve-base-") as base:
        archive = subprocess.run(["git", "archive", rev], cwd=HERE, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        ratios: dict = {}
        for r in range(args.rounds):
            for mode in args.modes:
                for b in args.batches:
                    got = {}
                    trees = (("base", base), ("this", HERE))
                    for name, tree in trees if r % 2 == 0 else trees[::-1]:
                        got[name] = statistics.median(runs := run_child(tree, mode, b, args))
                        print(f"round {r + 1} {mode} {'prefill' if args.prefill else 'batch'} {b} {name:4s} "
                              f"({rev if name == 'base' else 'tree'}): {got[name]:.1f} tok/s "
                              f"{[round(x, 1) for x in runs]}", flush=True)
                    ratios.setdefault((mode, b), []).append(got["this"] / got["base"])
        print(f"this tree / {rev}, per round:")
        for (mode, b), rs in ratios.items():
            print(f"  {mode} {'prefill' if args.prefill else 'batch'} {b}: " + " ".join(f"x{x:.3f}" for x in rs))


if __name__ == "__main__":
    main()
