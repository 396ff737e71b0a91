"""Sampling penalties (repetition / frequency / presence): the batched implementation in
moeserve/sample/processors.py against the per-request loop it replaced, same process, same inputs.

Each configuration: B requests, every one penalised (repetition_penalty 1.05..1.2, frequency_penalty 0.3,
presence_penalty 0.2, varying by request), --prompt-len prompt tokens and --output-len generated tokens
each (drawn from the first --distinct ids of the vocabulary, so tokens repeat as in text), --drafts MTP
draft rows per request, float32 logits [B * (drafts + 1), --vocab]. Both implementations are first checked
to give the same logits bit for bit; then each is timed --repeats times (the logits restored between calls,
outside the timing) and the median is printed, per step and per request, with the ratio old / new.
Figures, never pass/fail; on a shared machine run it twice.

Usage: python benchmarks/penalties.py [--vocab 129280] [--batches 1 16 64] [--output-len 200]
       [--prompt-len 1024] [--drafts 0] [--repeats 20] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeserve.sample import LogitsRows, apply_logits_processors  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
# BASELINE: the per-request loop before the batched rewrite (moeserve/layers/sampler.py at commit c4fa556), kept
# once as the spec in tests/sample/reference.py (its token-mask branch is skipped for these requests)
from tests.sample.reference import old_apply_logits_processors  # noqa: E402




def make_rows(batch: int, a: argparse.Namespace, g: torch.Generator) -> list[LogitsRows]:
    rows = []
    for i in range(batch):
        params = SamplingParams(repetition_penalty=1.05 + 0.15 * i / max(batch - 1, 1), frequency_penalty=0.3,
                                presence_penalty=0.2)
        ids = torch.randint(0, a.distinct, (a.prompt_len + a.output_len + a.drafts,), generator=g).tolist()
        rows.append(LogitsRows(params, set(), ids[:a.prompt_len], ids[a.prompt_len:a.prompt_len + a.output_len],
                               ids[a.prompt_len + a.output_len:]))
    return rows


def median_ms(fn, base: torch.Tensor, rows: list[LogitsRows], repeats: int) -> float:
    logits = base.clone()
    fn(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        logits.copy_(base)
        t0 = time.perf_counter()
        fn(logits, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--drafts", type=int, default=0, help="MTP draft tokens per request (rows = drafts + 1)")
    ap.add_argument("--distinct", type=int, default=5000, help="token ids drawn from [0, distinct)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"vocab {a.vocab}, {a.prompt_len} prompt + {a.output_len} output tokens per request, {a.drafts} drafts, "
          f"float32 logits, {a.threads} thread(s), median of {a.repeats}")
    print(f"{'requests':>8} {'rows':>5} {'old ms':>9} {'new ms':>8} {'old ms/req':>10} {'new ms/req':>10} "
          f"{'old/new':>8}")
    for batch in a.batches:
        rows = make_rows(batch, a, g)
        base = torch.randn(batch * (a.drafts + 1), a.vocab, generator=g)
        want, got = base.clone(), base.clone()
        old_apply_logits_processors(want, rows)
        apply_logits_processors(got, rows)
        if not torch.equal(want, got):
            raise SystemExit(f"batch {batch}: the implementations disagree; not timing them")
        old = median_ms(old_apply_logits_processors, base, rows, a.repeats)
        new = median_ms(apply_logits_processors, base, rows, a.repeats)
        print(f"{batch:>8} {base.shape[0]:>5} {old:>9.2f} {new:>8.2f} {old / batch:>10.3f} {new / batch:>10.3f} "
              f"{old / new:>7.1f}x")


if __name__ == "__main__":
    main()
