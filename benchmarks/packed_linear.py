"""BF16 GEMMs of decode sizes: F.linear against oneDNN's pre-packed weight (layers/linear.py packed_linear).

Usage: python benchmarks/packed_linear.py [--rows 1 2 8 32 128] [--repeats 5] [--threads 1]

The weight shapes of the decode_speed checkpoint's layers (q_a, q_b, kv_a, o_proj, dense MLP, lm_head). Each
call reads its weight from memory: a pool of copies larger than the last-level cache is cycled, so every call
finds its weight cold, as a decode step does. Per shape and row count: microseconds per call (median of
--repeats passes over the pool, CPU time of this thread), the ratio F.linear / packed, and whether the two
results are equal bit for bit. Where zentorch runs (AMD CPUs), also its prepacked BF16 linear (what the
engine's BF16 Linears run there). --int8 adds A8W8's INT8 GEMM on the same shapes as an A8W8 Linear of a
BF16 model runs it (layers/quant.py Int8LinearMethod: zentorch's dynamic-quantization INT8 linear where it
runs, else per-token quantization + oneDNN's packed INT8 GEMM), the oneDNN path alone beside it when the
two differ, and the ratio of the engine's BF16 linear to its INT8 one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moeserve.int8 import quantize_per_channel
from moeserve.layers.linear import pack_weight, packed_linear, zen_linear, zen_pack_weight
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
    zen = zen_pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None
    head = f" {'zen us':>8s}" if zen else ""
    if args.int8:
        head += f" {'int8 us':>8s}" + (f" {'oneDNN int8 us':>14s}" if zen else "") + f" {'bf16/int8':>9s}"
    print(f"{'weight':14s} {'rows':>5s} {'F.linear us':>12s} {'packed us':>10s} {'ratio':>6s} equal{head}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, POOL_BYTES // (2 * n * k))
        plain = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        packed = [pack_weight(w) for w in plain]
        if packed[0] is None:
            raise SystemExit("oneDNN packing is not available here (not CPU BF16 with mkldnn)")
        zens = [zen_pack_weight(w) for w in plain] if zen else []
        int8 = [_int8_layer(w) for w in plain] if args.int8 else []
        onednn = [_int8_layer(w, zentorch=False) for w in plain] if args.int8 and zen else []
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            equal = torch.equal(F.linear(x, plain[0]), packed_linear(x, packed[0]))
            a = per_call_us(F.linear, x, plain, args.repeats)
            b = per_call_us(packed_linear, x, packed, args.repeats)
            line = f"{name:14s} {m:5d} {a:12.1f} {b:10.1f} {a / b:6.2f} {equal}"
            if zens:
                b = per_call_us(zen_linear, x, zens, args.repeats)  # the engine's BF16 linear here
                line += f" {b:8.1f}"
            if int8:
                c = per_call_us(lambda xs, layer: Int8LinearMethod.apply(layer, xs), x, int8, args.repeats)
                line += f" {c:8.1f}"
                if onednn:
                    d = per_call_us(lambda xs, layer: Int8LinearMethod.apply(layer, xs), x, onednn, args.repeats)
                    line += f" {d:14.1f}"
                line += f" {b / c:9.2f}"
            print(line, flush=True)


def _int8_layer(w: torch.Tensor, zentorch: bool = True) -> torch.nn.Module:
    """What an A8W8 Linear of a BF16 model holds for this weight: INT8 [out, in], float32 scales, packed for
    zentorch where it runs (unless zentorch=False), else for oneDNN."""
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = quantize_per_channel(w)
    layer.bias = None
    layer.orig_dtype = torch.bfloat16 if zentorch else torch.float32  # float32: the oneDNN path
    Int8LinearMethod.process_weights_after_loading(layer)
    return layer


if __name__ == "__main__":
    with torch.inference_mode():
        main()
