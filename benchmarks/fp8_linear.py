"""CPU cost of a block-FP8 linear (tile-by-tile dequantization, layers/fp8.py) against the BF16 F.linear of
the same weight, in one process, alternating, best of --repeats (the machine is shared: the best run is the
least disturbed one). Prints time per call and the ratio fp8 / bf16 (> 1: FP8 slower).

    python benchmarks/fp8_linear.py --threads 1 --repeats 5
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from moeserve.layers.fp8 import fp8_matmul, quantize_block

SHAPES = {"expert w13 [512 x 1024]": (512, 1024), "q_b_proj [3072 x 384]": (3072, 384),
          "o_proj [1024 x 2048]": (1024, 2048), "DeepSeek-V3 expert gate [2048 x 7168]": (2048, 7168)}


def best(fn, repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| shape [N x K] | M | bf16 ms | fp8 ms | fp8 / bf16 |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        q, s = quantize_block(w)
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            inner = 20
            tb = best(lambda: F.linear(x, wb), args.repeats, inner)
            tf = best(lambda: fp8_matmul(x, q, s), args.repeats, inner)
            print(f"| {name} | {m} | {tb * 1e3:.3f} | {tf * 1e3:.3f} | {tf / tb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
