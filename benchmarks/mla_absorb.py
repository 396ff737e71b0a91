"""MLA decode's two per-head products with the absorbed matrices (W_UK on the query, W_UV on the latent output)
at decode row counts: mla.py's aten bmm's against vLLM's CPU library's bmm_cpu (layers/attention/mla_bmm.py).

Usage: python benchmarks/mla_absorb.py [--rows 1 2 4 8 16 32 64] [--repeats 5] [--threads 1]

Both sides run mla.py's own code (MLAttention.absorb_query / value_up, with and without the packed copies) on
DeepSeek-V3's latent dims (16 heads, C 512, dn = dv = 128, as benchmarks/decode_speed.py). Eight layers' matrices
are cycled so each call reads its weights from memory, as a decode step does. Per row count: microseconds per
layer and product (CPU time of this thread; aten and library alternated twice, each time the median of
--repeats, the lower of the two kept), the ratio library / aten, and whether the
outputs are bit-equal (the same arithmetic: float32 accumulation, one rounding; rare last-bit ties can differ).
Needs vLLM's CPU kernel library (layers/cpu_kernels.py; scripts/setup.sh installs it on CPUs with AVX-512 BF16).
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from moeserve.layers.attention import mla_bmm
from moeserve.layers.attention.mla import MLAttention

HEADS, C, DN, DV, LAYERS = 16, 512, 128, 128, 8


def layers(g: torch.Generator) -> list[SimpleNamespace]:
    """LAYERS stand-ins for MLAttention holding what absorb_query / value_up read (its process_weights_after_loading
    layout), with the library's packed copies beside them."""
    out = []
    for _ in range(LAYERS):
        w = (torch.randn(HEADS, DN + DV, C, generator=g) * 0.05).bfloat16()
        w_uk_t, w_uv = w[:, :DN].transpose(1, 2).contiguous(), w[:, DN:].contiguous()
        out.append(SimpleNamespace(w_uk_t=w_uk_t, w_uv=w_uv, w_uv_t=w_uv.transpose(1, 2), num_heads=HEADS, dv=DV,
                                   kv_lora_rank=C, UV_WEIGHT_FIRST_MAX_ROWS=MLAttention.UV_WEIGHT_FIRST_MAX_ROWS,
                                   packed=(mla_bmm.pack(w_uk_t), mla_bmm.pack(w_uv))))
    return out


def use_library(layer: SimpleNamespace, on: bool) -> None:
    layer.w_uk_packed, layer.w_uv_packed = layer.packed if on else (None, None)


def time_us(fn, layer_list, repeats: int, inner: int = 20) -> float:
    for layer in layer_list:
        fn(layer)
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            for layer in layer_list:
                fn(layer)
        runs.append((time.thread_time() - start) / (inner * len(layer_list)) * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layer_list = layers(g)
    if layer_list[0].packed[0] is None:
        raise SystemExit("vLLM's CPU kernel library's bmm_cpu is not usable here (layers/attention/mla_bmm.py)")
    products = {"W_UK": lambda layer, q, o: MLAttention.absorb_query(layer, q),
                "W_UV": lambda layer, q, o: MLAttention.value_up(layer, o)}
    with torch.no_grad():
        for rows in args.rows:
            q = torch.randn(rows, HEADS, DN, generator=g).bfloat16()
            o = torch.randn(rows, HEADS, C, generator=g).bfloat16()
            line = [f"rows {rows:4d}:"]
            for name, product in products.items():
                timed, outs = {}, {}
                for on in (False, True, False, True):  # alternated, the last of each kept
                    for layer in layer_list:
                        use_library(layer, on)
                    outs[on] = product(layer_list[0], q, o)
                    timed.setdefault(on, []).append(
                        time_us(lambda layer: product(layer, q, o), layer_list, args.repeats))
                aten, lib = min(timed[False]), min(timed[True])
                same = torch.equal(outs[False].reshape(rows, -1), outs[True].reshape(rows, -1))
                line.append(f"{name} aten {aten:7.1f} us  library {lib:7.1f} us  x{lib / aten:.2f}"
                            f"  {'same bits' if same else 'differs'}")
            print("  ".join(line))


if __name__ == "__main__":
    main()
