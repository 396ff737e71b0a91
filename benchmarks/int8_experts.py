"""Routed A8W8 (INT8) experts of one MoE layer at decode sizes: the per-expert path (Int8FusedExperts.forward:
rows grouped by expert, per-token quantization, one oneDNN / torch._int_mm GEMM per busy expert and
projection) against zentorch's fused MoE in its INT8 mode (layers/moe/zen.py fused_moe_int8: one call per
layer, activations quantized inside; AMD CPUs with zentorch installed).

Usage: python benchmarks/int8_experts.py [--batches 1 8 32 64] [--repeats 9] [--threads 1] [--rows]

The decode_speed checkpoint's expert shapes (64 experts, hidden 1024, moe_intermediate 256, top-6). Per decode
batch B: B tokens each routed to 6 distinct experts drawn at random (seeded). Two layers' worth of weights are
alternated so the weights come from memory, not cache. Each repeat times both paths back to back (interleaved,
so drifts in the machine's load hit both alike). Per batch: milliseconds per layer (median of --repeats, CPU
time of this thread and wall time, with the spread min/max around the median), the ratio per-expert / zentorch
(median of the per-repeat ratios, and their range), and the largest difference of each path from a float32
reference on the dequantized weights, relative to the reference's largest value. --rows sends zentorch the
B x 6 (token, expert) rows one expert each (the EP dispatchers' row interface) instead of the B tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moeserve.int8 import quantize_per_channel
from moeserve.layers.moe import zen
from moeserve.layers.quant import Int8FusedExperts

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 1024, 256, 6


def layer(seed: int) -> Int8FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = Int8FusedExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        for w, s in ((ex.w13, ex.w13_scale), (ex.w2, ex.w2_scale)):
            q, scale = quantize_per_channel(torch.randn(w.shape, generator=g) * 0.02)
            w.copy_(q)
            s.copy_(scale[..., 0])
    return ex


def per_expert(ex: Int8FusedExperts, x, ids, w) -> torch.Tensor:
    """The per-expert INT8 path (process_weights_after_loading(fused_kernels=False)): one row per (token, expert)
    pair through forward(), summed per token."""
    return ex.forward_topk(x, ids, w)


def zentorch(ex: Int8FusedExperts, x, ids, w) -> torch.Tensor:
    """What Int8FusedExperts.forward_topk runs with zentorch (zen.fused_moe_int8, eager)."""
    return ex.forward_topk(x, ids, w)


def zentorch_rows(ex: Int8FusedExperts, x, ids, w) -> torch.Tensor:
    """The row interface of the EP dispatchers through zentorch: the B x 6 (token, expert) rows, k = 1."""
    t, k = ids.shape
    return ex(x.repeat_interleave(k, dim=0), ids.reshape(-1), w.reshape(-1)).view(t, k, -1).sum(dim=1)


def reference(ex: Int8FusedExperts, x, ids, w) -> torch.Tensor:
    """float32 on the dequantized weights, activations not quantized."""
    w13, w2 = ex.dequantized()
    h = torch.einsum("th,tkih->tki", x.float(), w13[ids])
    gate, up = h.split(ex.intermediate, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2[ids])
    return (y * w[..., None]).sum(dim=1)


def timed(fn, layers, x, ids, w) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for ex in layers:
        fn(ex, x, ids, w)
    return ((time.thread_time() - c0) / len(layers) * 1e3, (time.perf_counter() - t0) / len(layers) * 1e3)


def spread(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:6.3f} ({(min(xs) / m - 1) * 100:+.0f}/{(max(xs) / m - 1) * 100:+.0f}%)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", action="store_true", help="time zentorch through the row interface (k = 1)")
    args = ap.parse_args()
    if not zen.available():
        raise SystemExit("zentorch's fused MoE is not available here (layers/moe/zen.py)")
    torch.set_num_threads(args.threads)
    layers = [layer(s) for s in (1, 2)]
    zlayers = [layer(s) for s in (1, 2)]
    for ex in layers:
        ex.process_weights_after_loading(fused_kernels=False)
    for ex in zlayers:
        ex.process_weights_after_loading()
        assert ex.fused
    print(f"threads {torch.get_num_threads()}; ms per layer, median (min/max vs median) of {args.repeats} repeats")
    print(f"{'batch':>5s} {'per-expert cpu':>20s} {'zentorch cpu':>20s} {'ratio (range)':>18s} "
          f"{'per-expert wall':>20s} {'zentorch wall':>20s} {'wall ratio':>10s}  "
          "max|diff|/max|ref| per-expert zentorch")
    g = torch.Generator().manual_seed(0)
    for b in args.batches:
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(b)])
        x = torch.randn(b, HIDDEN, generator=g).to(torch.bfloat16)
        w = torch.rand(b, TOP_K, generator=g)
        ref = reference(layers[0], x, ids, w)
        scale = ref.abs().max().item()
        e_old = (per_expert(layers[0], x, ids, w).float() - ref).abs().max().item() / scale
        new = zentorch_rows if args.rows else zentorch
        e_new = (new(zlayers[0], x, ids, w).float() - ref).abs().max().item() / scale
        timed(per_expert, layers, x, ids, w)  # warm-up: oneDNN primitives, zentorch's reordered weights
        timed(new, zlayers, x, ids, w)
        oc, ow, nc, nw = [], [], [], []
        for _ in range(args.repeats):
            c, t = timed(per_expert, layers, x, ids, w)
            oc.append(c)
            ow.append(t)
            c, t = timed(new, zlayers, x, ids, w)
            nc.append(c)
            nw.append(t)
        ratios = sorted(o / n for o, n in zip(oc, nc))
        wall = statistics.median(o / n for o, n in zip(ow, nw))
        print(f"{b:5d} {spread(oc):>20s} {spread(nc):>20s} {statistics.median(ratios):6.2f} "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}) {spread(ow):>20s} {spread(nw):>20s} {wall:10.2f}  "
              f"{e_old:.4f} {e_new:.4f}", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
