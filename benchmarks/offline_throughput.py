"""Decode throughput of moeserve vs transformers' generate() in BF16, same checkpoint, same process.

Usage: python benchmarks/offline_throughput.py [--batches 1 8 32] [--prompt-len 128] [--new-tokens 64]
Prints tokens/s for both, their ratio, the machine's memory bandwidth, the active-weight bytes per token and
the fraction of the bandwidth roofline moeserve reaches at batch 1.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import BENCH_CONFIG, bench_checkpoint, memory_bandwidth_gbs, param_counts


def moeserve_decode_tps(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from moeserve import SamplingParams

    prompts = [[(7 * i + j) % 31000 + 2 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    total = time.perf_counter() - t0
    return batch * (new_tokens - 1) / max(total - prefill, 1e-9)


def hf_decode_tps(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor([[(7 * i + j) % 31000 + 2 for j in range(prompt_len)] for i in range(batch)])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    return batch * (new_tokens - 1) / max(total - prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's). On a loaded machine use 1: a second OpenMP thread "
                         "waiting for a busy core stalls every small GEMM")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from moeserve import LLM

    path = bench_checkpoint()
    counts = param_counts(BENCH_CONFIG)
    bw = memory_bandwidth_gbs()
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
              enable_prefix_caching=False)  # the same prompts run again: measure compute, not the prefix cache
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows = []
    for b in args.batches:
        ours = moeserve_decode_tps(llm, b, args.prompt_len, args.new_tokens)
        ref = hf_decode_tps(hf, b, args.prompt_len, args.new_tokens) if hf is not None else float("nan")
        rows.append({"batch": b, "moeserve_tok_s": ours, "transformers_tok_s": ref, "ratio": ours / ref})
    active_bytes = counts["active"] * 2
    roofline_b1 = bw * 1e9 / active_bytes
    report = {"params_total_M": counts["total"] / 1e6, "active_params_per_token_M": counts["active"] / 1e6,
              "active_weight_bytes_per_token_MB": active_bytes / 1e6, "memory_bandwidth_GBs": bw,
              "roofline_tok_s_batch1": roofline_b1, "threads": torch.get_num_threads(), "rows": rows}
    if rows and rows[0]["batch"] == 1:
        report["roofline_fraction_batch1"] = rows[0]["moeserve_tok_s"] / roofline_b1
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"params {report['params_total_M']:.0f}M, active/token {report['active_params_per_token_M']:.0f}M "
          f"({report['active_weight_bytes_per_token_MB']:.0f} MB BF16); memory bandwidth {bw:.1f} GB/s; "
          f"roofline at batch 1 {roofline_b1:.1f} tok/s; {report['threads']} threads")
    print(f"{'batch':>5} {'moeserve tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['moeserve_tok_s']:>15.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>7.2f}")
    if "roofline_fraction_batch1" in report:
        print(f"batch-1 roofline fraction: {report['roofline_fraction_batch1']:.0%}")


if __name__ == "__main__":
    main()
