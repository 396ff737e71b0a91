"""`moeserve quantize SRC DST`: write a compressed-tensors W8A8 INT8 checkpoint, so later starts load INT8
directly instead of quantizing at load."""
from __future__ import annotations

import os
import sys
import time

from moeserve.help_format import HelpFormatter
from moeserve.engine_flags import _parse_size


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write a W8A8 INT8 (compressed-tensors) copy of a checkpoint",
                       formatter_class=HelpFormatter)
    p.add_argument("src", help="BF16 / FP32 / DeepSeek FP8 checkpoint folder")
    p.add_argument("dst", help="output folder (must not exist or be empty)")
    p.add_argument("--shard-size", type=_parse_size, default="4G", help="bytes per safetensors shard")
    p.set_defaults(func=run)


def run(args) -> int:
    from moeserve.models.quantized_writer import quantize_checkpoint

    if not os.path.isfile(os.path.join(args.src, "config.json")):
        raise FileNotFoundError(f"SRC {args.src!r} is not a checkpoint folder: it has no config.json")
    if args.shard_size <= 0:  # 0 would put every tensor in a shard of its own
        raise ValueError(f"--shard-size must be a positive size such as 4G or 512M, got {args.shard_size}")
    start = time.perf_counter()
    summary = quantize_checkpoint(args.src, args.dst, args.shard_size)
    print(f"wrote {args.dst}: {summary['int8_tensors']} INT8 weights in {summary['shards']} shard(s) "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0
