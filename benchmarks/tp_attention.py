"""Attention tensor parallelism, three ways, on the same run: plain TP (all-reduce of o_proj's partial sums),
FlashComm (--flashcomm on: reduce-scatter + all-gather of the normed hidden state) and the TP<->DP switch
(--attention-tp-dp-switch: q_a / kv_a on the token shard, all-gather of the projected query and latent).

Usage: python benchmarks/tp_attention.py [--tp 2] [--prompts 8] [--prompt-len 128] [--repeats 3]

Model: benchmarks/dp_ep.py's shrunk bench config (hidden 512, q_lora 192, kv_lora 128, rope 32: the switch
gathers 352 values per token where FlashComm gathers 512; DeepSeek-V3's are 2112 against 7168), BF16, rank
processes over gloo on this machine. Per mode: prefill tokens/s (wall time of a batch of prompts with one new
token each, median of --repeats with the spread, the modes interleaved) and the bytes each rank sent per
prompt token per layer by the attention collectives (allreduce, allgather_tp, and the reduce_scatter of
attention; the MoE's own collectives excluded: its experts are TP-sharded the same way in every mode).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_checkpoint  # noqa: E402
from benchmarks.dp_ep import SHRUNK  # noqa: E402

MODES = {"plain TP": {}, "flashcomm": {"flashcomm": "on"}, "tp<->dp switch": {"attention_tp_dp_switch": True}}
ATTENTION_KINDS = ("allreduce", "allgather_tp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from moeserve import LLM, SamplingParams

    path = bench_checkpoint(config=SHRUNK)
    one = SamplingParams(temperature=0, max_tokens=1)
    layers = SHRUNK["num_hidden_layers"]
    llms = {m: LLM(path, dtype="bfloat16", tensor_parallel_size=args.tp, enable_prefix_caching=False,
                   max_num_batched_tokens=args.prompts * args.prompt_len, **kw) for m, kw in MODES.items()}
    try:
        times: dict[str, list[float]] = {m: [] for m in MODES}
        sent: dict[str, dict] = {}
        for r in range(args.repeats + 1):  # the first round warms up
            prompts = [[(13 * i + 7 * r + j) % (SHRUNK["vocab_size"] - 2) + 2 for j in range(args.prompt_len)]
                       for i in range(args.prompts)]
            for m, llm in llms.items():
                before = dict(llm.engine.stats().comm_bytes)
                t0 = time.perf_counter()
                llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)
                if r:
                    times[m].append(time.perf_counter() - t0)
                    after = dict(llm.engine.stats().comm_bytes)
                    sent[m] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        tokens = args.prompts * args.prompt_len
        base = statistics.median(times["plain TP"])
        print(f"TP={args.tp}, {args.prompts} x {args.prompt_len}-token prompts, BF16")
        print(f"{'mode':<16}{'prefill tok/s':>14}{'spread':>12}{'vs plain':>9}{'attn B/token/layer':>20}")
        for m in MODES:
            med = statistics.median(times[m])
            lo, hi = min(times[m]) / med - 1, max(times[m]) / med - 1
            attn = sum(sent[m].get(k, 0) for k in ATTENTION_KINDS)
            if m != "plain TP":  # the attention's reduce-scatter (the MoE's own sums travel as "reduce_scatter"
                attn += sent[m].get("reduce_scatter", 0) - sent["plain TP"].get("reduce_scatter", 0)  # in all)
            print(f"{m:<16}{tokens / med:>14.1f}{f'{-hi * 100:+.0f}/{-lo * 100:+.0f}%':>12}{base / med:>9.2f}"
                  f"{attn / (tokens * layers):>20.0f}")
    finally:
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
