"""The A8W8 lm_head with and without its top candidates re-scored (layers/logits_head.py), at decode row counts.

Usage: python benchmarks/int8_head.py [--rows 1 8 32] [--vocab 32000] [--hidden 1024] [--repeats 5] [--threads 1]

One INT8 `Linear` the shape of benchmarks/decode_speed.py's lm_head (BF16 model, weights quantized at load and
packed for the kernel the engine runs here), called as the model calls it: `lm_head(x).float()` (the INT8 GEMM
alone) against `head_logits(lm_head, x)` (GEMM + the re-scoring). Per row count: the median milliseconds of 40
calls, --repeats times alternated, the median and spread of each and of their ratio, CPU time of this thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeserve.layers.linear import Linear
from moeserve.layers.logits_head import head_logits
from moeserve.layers.quant import Int8LinearMethod


def int8_head(vocab: int, hidden: int) -> Linear:
    head = Linear(hidden, vocab)
    head.weight.data = head.weight.data.to(torch.bfloat16)
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    Int8LinearMethod.create_weights(head)
    Int8LinearMethod.load_tensor(head, "weight", weight, "lm_head.weight")
    head.process_weights_after_loading()
    return head


def median_ms(fn, calls: int = 40) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def spread(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:.3f} ({min(xs) / m - 1:+.0%}/{max(xs) / m - 1:+.0%})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    head = int8_head(args.vocab, args.hidden)
    print(f"INT8 lm_head [{args.vocab} x {args.hidden}], {args.threads} thread(s): ms per call, median (spread)")
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.hidden).to(torch.bfloat16)
            gemm, rescored = [], []
            for _ in range(args.repeats):
                gemm.append(median_ms(lambda: head(x).float()))
                rescored.append(median_ms(lambda: head_logits(head, x)))
            ratio = [r / g for r, g in zip(rescored, gemm)]
            print(f"rows {rows:3d}: GEMM {spread(gemm)}, GEMM + re-scoring {spread(rescored)}, "
                  f"ratio x{spread(ratio)}", flush=True)


if __name__ == "__main__":
    main()
