"""BF16 GEMMs of decode sizes: F.linear against oneDNN's pre-packed weight (layers/linear.py packed_linear).

Usage: python benchmarks/packed_linear.py [--rows 1 2 8 32 128] [--repeats 5] [--threads 1]

The weight shapes of the decode_speed checkpoint's layers (q_a, q_b, kv_a, o_proj, dense MLP, lm_head). Each
call reads its weight from memory: a pool of copies larger than the last-level cache is cycled, so every call
finds its weight cold, as a decode step does. Per shape and row count: microseconds per call (median of
--repeats passes over the pool, CPU time of this thread), the ratio F.linear / packed, and whether the two
results are equal bit for bit. --int8 adds A8W8's INT8 GEMM on the same shapes (layers/quant.py int8_linear:
per-token activation quantization, INT8 weight, float32 epilogue; what an A8W8 Linear, lm_head included, runs)
and the ratio packed BF16 / INT8.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moeserve.int8 import quantize_per_channel
from moeserve.layers.linear import pack_weight, packed_linear
from moeserve.layers.quant import Int8LinearMethod

SHAPES = {"q_a_proj": (384, 1024), "q_b_proj": (3072, 384), "kv_a_proj": (576, 1024), "o_proj": (1024, 2048),
          "dense_gate_up": (2 * 2048, 1024), "lm_head": (32000, 1024)}
POOL_BYTES = 256 << 20


def per_call_us(fn, xs, weights, repeats: int) -> float:
    passes = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for w in weights:
            fn(xs, w)
        passes.append((time.thread_time() - t0) / len(weights) * 1e6)
    return statistics.median(passes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--int8", action="store_true", help="also time A8W8's INT8 GEMM on the same shapes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    extra = f" {'int8 us':>8s} {'packed/int8':>11s}" if args.int8 else ""
    print(f"{'weight':14s} {'rows':>5s} {'F.linear us':>12s} {'packed us':>10s} {'ratio':>6s} equal{extra}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, POOL_BYTES // (2 * n * k))
        plain = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        packed = [pack_weight(w) for w in plain]
        if packed[0] is None:
            raise SystemExit("oneDNN packing is not available here (not CPU BF16 with mkldnn)")
        int8 = [_int8_layer(w) for w in plain] if args.int8 else []
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            equal = torch.equal(F.linear(x, plain[0]), packed_linear(x, packed[0]))
            a = per_call_us(F.linear, x, plain, args.repeats)
            b = per_call_us(packed_linear, x, packed, args.repeats)
            line = f"{name:14s} {m:5d} {a:12.1f} {b:10.1f} {a / b:6.2f} {equal}"
            if int8:
                c = per_call_us(lambda xs, layer: Int8LinearMethod.apply(layer, xs), x, int8, args.repeats)
                line += f" {c:8.1f} {b / c:11.2f}"
            print(line, flush=True)


def _int8_layer(w: torch.Tensor) -> torch.nn.Module:
    """What an A8W8 Linear holds for this weight: INT8 [out, in], float32 scales, oneDNN packing where AMX runs it."""
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = quantize_per_channel(w)
    layer.bias = None
    Int8LinearMethod.process_weights_after_loading(layer)
    return layer


if __name__ == "__main__":
    with torch.inference_mode():
        main()
