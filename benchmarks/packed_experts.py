"""Routed BF16 experts of one MoE layer at decode sizes: torch._grouped_mm on the stacked weights (the path
without packing) against the per-expert GEMMs on oneDNN-packed copies (layers/moe/experts.py packed_forward).

Usage: python benchmarks/packed_experts.py [--batches 1 8 32 64] [--repeats 7] [--threads 1] [--gathered]
           [--zentorch]

The decode_speed checkpoint's expert shapes (64 experts, hidden 1024, moe_intermediate 256, top-6). Per decode
batch B: B tokens each routed to 6 distinct experts drawn at random (seeded), so the rows per expert vary as
they do in a real step. Two layers' worth of weights are alternated so the weights come from memory, not cache.
Per batch: milliseconds per layer (median of --repeats, CPU time of this thread, with the spread), the ratio
grouped / packed, and the largest difference between the two outputs (BF16 rounding of different GEMM kernels).
--gathered adds the compiled graphs' few-row path (FusedExperts.gathered_forward through torch.compile: each row
reads its expert's weights) and the ratio packed / gathered, which sets FusedExperts.GATHER_ROWS_PER_SLOT.
--zentorch adds zentorch's fused MoE (layers/moe/zen.py; AMD CPUs with zentorch installed) over the same
routing, one call per layer from the B tokens (not the B x 6 rows), the ratio packed / zentorch, and its largest
difference from the grouped path's weighted sum per token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeserve.layers.moe.experts import FusedExperts

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 1024, 256, 6


def layer(seed: int, packed: bool, zentorch: bool = False) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(EXPERTS, HIDDEN, INTERMEDIATE).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.02)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.02)
    if zentorch:
        ex.process_weights_after_loading()
        if not ex.fused:
            raise SystemExit("zentorch's fused MoE is not available here (layers/moe/zen.py)")
    elif packed:
        ex.process_weights_after_loading(fused_kernels=False)
        if ex.packed is None:
            raise SystemExit("oneDNN BF16 packing is not available here")
    return ex


def per_layer_ms(layers: list[FusedExperts], x, ids, w, repeats: int) -> list[float]:
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for ex in layers:
            ex(x, ids, w)
        runs.append((time.thread_time() - t0) / len(layers) * 1e3)
    return runs


def spread(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:7.2f} ({(min(xs) / m - 1) * 100:+.0f}/{(max(xs) / m - 1) * 100:+.0f}%)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gathered", action="store_true", help="also time the compiled gathered path")
    ap.add_argument("--zentorch", action="store_true", help="also time zentorch's fused MoE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grouped = [layer(s, packed=False) for s in (1, 2)]
    packed = [layer(s, packed=True) for s in (1, 2)]
    zen = [layer(s, packed=False, zentorch=True) for s in (1, 2)] if args.zentorch else []
    print(f"{'batch':>5s} {'rows':>5s} {'grouped ms':>18s} {'packed ms':>18s} {'ratio':>6s} max|diff|"
          + ("  gathered ms (packed/gathered)" if args.gathered else "")
          + ("  zentorch ms (packed/zentorch, max|diff|)" if args.zentorch else ""))
    g = torch.Generator().manual_seed(0)
    for b in args.batches:
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(b)]).view(-1)
        x = torch.randn(ids.numel(), HIDDEN, generator=g).to(torch.bfloat16)
        w = torch.rand(ids.numel(), generator=g)
        diff = (grouped[0](x, ids, w).float() - packed[0](x, ids, w).float()).abs().max().item()
        per_layer_ms(grouped + packed, x, ids, w, 1)  # warm-up: oneDNN primitives for these sizes
        a, p = [], []
        for _ in range(args.repeats):  # interleaved, so drifts in the machine's load hit both alike
            a += per_layer_ms(grouped, x, ids, w, 1)
            p += per_layer_ms(packed, x, ids, w, 1)
        ratios = sorted(x / y for x, y in zip(a, p))
        extra = ""
        if args.gathered:
            fn = torch.compile(lambda ex, *t: ex.gathered_forward(*t), fullgraph=True, dynamic=False)
            for ex in packed:
                fn(ex, x, ids, w)  # compile, then warm
            gt = []
            for _ in range(args.repeats):
                t0 = time.thread_time()
                for ex in packed:
                    fn(ex, x, ids, w)
                gt.append((time.thread_time() - t0) / len(packed) * 1e3)
            extra = f"  {spread(gt)} ({statistics.median(p) / statistics.median(gt):.2f})"
        if zen:
            tokens = torch.randn(b, HIDDEN, generator=g).to(torch.bfloat16)
            ids2, w2 = ids.view(b, TOP_K), w.view(b, TOP_K)
            zdiff = (grouped[0].forward_topk(tokens, ids2, w2).float()
                     - zen[0].forward_topk(tokens, ids2, w2).float()).abs().max().item()
            for ex in zen:  # warm-up: zentorch reorders each expert's weights on first use
                ex.forward_topk(tokens, ids2, w2)
            zt = []
            for _ in range(args.repeats):
                t0 = time.thread_time()
                for ex in zen:
                    ex.forward_topk(tokens, ids2, w2)
                zt.append((time.thread_time() - t0) / len(zen) * 1e3)
            extra += f"  zentorch {spread(zt)} ({statistics.median(p) / statistics.median(zt):.2f}, {zdiff:.1e})"
        print(f"{b:5d} {ids.numel():5d} {spread(a):>18s} {spread(p):>18s} {statistics.median(ratios):6.2f} "
              f"{diff:.2e}  (per-repeat ratios {ratios[0]:.2f}-{ratios[-1]:.2f}){extra}", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
