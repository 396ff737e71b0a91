"""Absorbed MLA decode attention per layer (layers/attention/mla.py `_decode`'s core) at decode batch sizes and
context lengths, on DeepSeek-V3's latent dims (kv_lora 512 + rope 64, 16 heads as in benchmarks/decode_speed.py).

Usage: python benchmarks/mla_decode.py [--batches 1 8 32] [--contexts 128 1024] [--repeats 5] [--threads 1]

Compared in one run, on the same inputs: two bmm's (scores, then the value product over all C + dr columns,
the output sliced) around an eager float32 softmax (what mla.py did from 2026-12-06 to 2026-12-07), and
SDPA's flash kernel with each row's heads as the queries of one KV head (what it does now). Each (batch,
context) gets 8 layers' worth of contexts, cycled so that every call reads its KV from memory, as a decode
step does. Per variant: milliseconds per layer (median of --repeats, CPU time of this thread), the ratio,
the FLOP rate and KV read rate the new time implies (the scores and the value product are 2 x B x H x L x
(C + dr) multiply-adds each; the gather of the context from the paged cache is left out, it is the same for
both), and each variant's largest error against a float32 reference on the first layer's inputs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, C, R = 16, 512, 64


SCALE = 0.1


def attend_bmm(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.bmm(q_full, kv.transpose(1, 2)).float() * SCALE
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    return torch.bmm(probs, kv)[..., :C]


def attend_sdpa(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kv = kv[:, None]
    o = F.scaled_dot_product_attention(q_full[:, None], kv, kv, attn_mask=~mask[:, None, None, :], scale=SCALE)
    return o[:, 0, :, :C]


def reference(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return attend_bmm(q_full.float(), kv.float(), mask)


def per_layer_ms(fn, layers, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for args in layers:
            fn(*args)
        runs.append((time.thread_time() - t0) / len(layers) * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{'batch':>5s} {'context':>7s} {'bmm ms':>8s} {'sdpa ms':>8s} {'ratio':>6s} {'GFLOP/s':>8s} "
          f"{'KV GB/s':>8s} {'bmm err':>8s} {'sdpa err':>8s}")
    for b in args.batches:
        for length in args.contexts:
            layers = []
            for _ in range(8):
                kv = torch.randn(b, length, C + R, generator=g).to(torch.bfloat16)
                lens = torch.randint(max(1, length - 16), length + 1, (b,), generator=g)
                q = torch.randn(b, HEADS, C + R, generator=g).to(torch.bfloat16)
                layers.append((q, kv, torch.arange(length)[None, :] >= lens[:, None]))
            exact = reference(*layers[0])
            errs = [(fn(*layers[0]).float() - exact).abs().max().item() for fn in (attend_bmm, attend_sdpa)]
            old = per_layer_ms(attend_bmm, layers, args.repeats)
            new = per_layer_ms(attend_sdpa, layers, args.repeats)
            flops = 2 * 2 * b * HEADS * length * (C + R)
            kv_bytes = b * length * (C + R) * 2
            print(f"{b:5d} {length:7d} {old:8.2f} {new:8.2f} {old / new:6.2f} {flops / new / 1e6:8.1f} "
                  f"{kv_bytes / new / 1e6:8.1f} {errs[0]:8.1e} {errs[1]:8.1e}", flush=True)

if __name__ == "__main__":
    with torch.inference_mode():
        main()
