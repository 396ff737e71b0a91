"""`moeserve bench serve`: the serving benchmark (works against any OpenAI-compatible server)."""
from __future__ import annotations

import argparse

from moeserve.help_format import HelpFormatter


class _Given(argparse.Action):
    """Store the value and remember that the user gave it (ShareGPT output lengths default to the data's)."""

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, values)
        setattr(ns, self.dest + "_given", True)


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    p = bsub.add_parser("serve", help="serving benchmark: TTFT, TPOT, ITL, E2EL, throughput, goodput",
                        formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   action=_Given)
    p.add_argument("--model", required=True, help="model name the server serves (see /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model if a folder, else "
                   "the server's model root from /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    p.add_argument("--input-len", type=int, default=128, help="random: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=32, action=_Given,
                   help="random: mean output tokens; sharegpt: fixed output tokens (default: the reply's)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in L*(1 +- r)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one shared prefix before every prompt (measures prefix caching)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension) for exact lengths")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--e2el-slo-ms", type=float, default=None)
    p.add_argument("--num-devices", type=int, default=1, help="accelerators serving (for tok/s per device)")
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--result-json", default=None, help="write every figure and per-request data here")
    p.add_argument("--plot", default=None, help="write latency distributions to this PNG")
    p.add_argument("--no-progress", action="store_true")
    from moeserve.bench.vllm_compat import add_vllm_flags
    add_vllm_flags(p, _Given)
    p.set_defaults(func=_run, output_len_given=False, endpoint_given=False)


def _run(args) -> int:
    from moeserve.bench.serve import run
    from moeserve.bench.vllm_compat import normalise

    normalise(args)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers like 90,99, got {args.metric_percentiles!r}")
    if not all(0 < p < 100 for p in percentiles):
        raise ValueError("--metric-percentiles must lie strictly between 0 and 100")
    return run(args)
