"""Decode tokens/s with --quantization a8w8 vs BF16 on the core engine's bench config, same process.

Usage: python benchmarks/quant_decode.py [--batches 1 8 32] [--new-tokens 32] [--repeats 3] [--threads 1]
           [--per-expert-int8]
--per-expert-int8 adds a third engine, A8W8 with the routed experts on the per-expert INT8 path
(MOESERVE_ZENTORCH_INT8=0) where the a8w8 engine runs them on zentorch's INT8 fused MoE (AMD CPUs with
zentorch: layers/quant.py Int8FusedExperts), alternated with the other two.
Each (batch, mode) is measured `repeats` times, alternating modes, in process CPU time with one thread, and
the best run counts (the machine is shared; CPU time excludes waiting for a core, the best run is the least
disturbed). Also prints: the INT8 linear against the BF16 linear on the
bench's expert and attention shapes (weights streamed from memory), and the bytes per token of an MoE dispatch payload in INT8 (values +
per-token float32 scale) vs BF16, from the real quantized tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import BENCH_CONFIG, bench_checkpoint  # noqa: E402
from moeserve.layers.quant import Int8Packed, int8_linear, quantize_per_channel, quantize_per_token  # noqa: E402


def _best_ms(fn, repeats: int = 64) -> float:
    fn(0)
    best = float("inf")
    for r in range(repeats):
        t = time.process_time()
        fn(r)
        best = min(best, time.process_time() - t)
    return best * 1e3


def gemm_table(batch_rows: list[int], copies: int = 64) -> list[dict]:
    """INT8 linear (quantize x, oneDNN packed GEMM, dequantize) vs BF16 F.linear on bench shapes [M, K] x [N, K].

    Each call uses the next of `copies` distinct weights (64 = one layer's experts), so weights come from
    memory as in the model rather than from cache."""
    h, i = BENCH_CONFIG["hidden_size"], BENCH_CONFIG["moe_intermediate_size"]
    shapes = {"expert w13": (2 * i, h), "expert w2": (h, i), "q_b_proj": (16 * 192, 384), "o_proj": (h, 16 * 128)}
    rows = []
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        wb, wq = [w.to(torch.bfloat16) for w in ws], [quantize_per_channel(w) for w in ws]
        packs = [Int8Packed.of(q, s) for q, s in wq]  # as the engine packs them at load
        for m in batch_rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            bf16 = _best_ms(lambda r: F.linear(x, wb[r % copies]))
            int8 = _best_ms(lambda r: int8_linear(x, *wq[r % copies], packed=packs[r % copies]))
            rows.append(dict(shape=name, M=m, N=n, K=k, bf16_ms=bf16, int8_ms=int8, speedup=bf16 / int8))
    return rows


def dispatch_bytes(tokens: int = 32) -> dict:
    """Bytes per token copy sent to an expert rank: BF16 hidden vs INT8 hidden + one float32 scale."""
    x = torch.randn(tokens, BENCH_CONFIG["hidden_size"], dtype=torch.bfloat16)
    q, s = quantize_per_token(x)
    bf16 = x.numel() * x.element_size() / tokens
    int8 = (q.numel() * q.element_size() + s.numel() * s.element_size()) / tokens
    return dict(bf16_bytes_per_token=bf16, int8_bytes_per_token=int8, ratio=int8 / bf16)


def decode_tps(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s in process CPU time (one thread: CPU time ~ wall time on an idle machine, and other
    jobs on a shared one do not count): (batch x new_tokens run) - (the same prefill alone)."""
    from moeserve import SamplingParams

    prompts = [[(7 * i + j) % 31000 + 2 for j in range(prompt_len)] for i in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt_token_ids=prompts, sampling_params=one)  # warm-up
    t0 = time.process_time()
    llm.generate(prompt_token_ids=prompts, sampling_params=one)
    prefill = time.process_time() - t0
    t0 = time.process_time()
    llm.generate(prompt_token_ids=prompts,
                 sampling_params=SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    return batch * (new_tokens - 1) / max(time.process_time() - t0 - prefill, 1e-9)


def decode_table(args) -> list[dict]:
    from moeserve import LLM

    path = bench_checkpoint()
    seqs = max(args.batches)
    kw = dict(dtype="bfloat16", max_num_seqs=seqs, enable_prefix_caching=False)  # the same prompts run again: measure compute, not the prefix cache
    llms = {"bf16": LLM(path, **kw), "a8w8": LLM(path, quantization="a8w8", **kw)}
    if args.per_expert_int8:  # read when the experts are loaded (layers/moe/zen.py usable_int8)
        prev = os.environ.get("MOESERVE_ZENTORCH_INT8")
        os.environ["MOESERVE_ZENTORCH_INT8"] = "0"
        try:
            llms["a8w8_per_expert"] = LLM(path, quantization="a8w8", **kw)
        finally:
            if prev is None:
                del os.environ["MOESERVE_ZENTORCH_INT8"]
            else:
                os.environ["MOESERVE_ZENTORCH_INT8"] = prev
    rows = []
    for b in args.batches:
        best = {m: 0.0 for m in llms}
        for _ in range(args.repeats):
            for mode, llm in llms.items():
                best[mode] = max(best[mode], decode_tps(llm, b, args.prompt_len, args.new_tokens))
        rows.append(dict(batch=b, bf16_tps=best["bf16"], a8w8_tps=best["a8w8"], speedup=best["a8w8"] / best["bf16"]))
        extra = ""
        if "a8w8_per_expert" in best:
            pe = best["a8w8_per_expert"]
            rows[-1].update(a8w8_per_expert_tps=pe, per_expert_speedup=pe / best["bf16"])
            extra = f"  a8w8 per-expert {pe:8.1f} tok/s  x{pe / best['bf16']:.2f}"
        print(f"batch {b:3d}: bf16 {best['bf16']:8.1f} tok/s  a8w8 {best['a8w8']:8.1f} tok/s  "
              f"x{best['a8w8'] / best['bf16']:.2f}{extra}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--per-expert-int8", action="store_true",
                    help="also time A8W8 with the routed experts off zentorch (MOESERVE_ZENTORCH_INT8=0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    decode = [] if args.skip_decode else decode_table(args)
    gemms = gemm_table([1, 3, 8, 32, 192])
    for r in gemms:
        print(f"{r['shape']:11s} M={r['M']:4d}: bf16 {r['bf16_ms']:.3f} ms  int8 {r['int8_ms']:.3f} ms  "
              f"x{r['speedup']:.2f}")
    comm = dispatch_bytes()
    print(f"dispatch payload per token: bf16 {comm['bf16_bytes_per_token']:.0f} B, int8 "
          f"{comm['int8_bytes_per_token']:.0f} B (x{comm['ratio']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, decode=decode, gemm=gemms, dispatch=comm), f, indent=2)


if __name__ == "__main__":
    main()
