"""Sampling per step: the batched sampler (moeserve/sample/) against the per-request loop it replaced, in
the same run, and decode with mixed sampling parameters against greedy decode on the V3-shaped checkpoint.

Part 1 (always): B rows of float32 logits [B, --vocab] shaped like a model's (bfloat16 values, so ties, as
compute_logits gives them), B in --batches, every row with its own mix of parameters (MIX below: greedy,
temperature, top-k, top-p, min-p, logprobs, a seed on 1 row in 8). Per batch: the old loop (copied below,
unchanged but for the names) and Sampler are first checked to draw the same tokens for the seeded and
greedy rows; then each is timed --repeats times, alternating, in this thread's CPU time, with the new sampler
also on the same rows without the seed ("new, no seed": every sampled row on the candidate path); printed:
the median ms per step, the spread (min..max as % of the median) and the median of the per-repeat old / new.

Part 2 (--decode): LLM on the V3-shaped checkpoint of benchmarks/decode_speed.py (compiled decode unless
--eager), --decode-batch requests of --prompt-len tokens, --new-tokens each (ignore_eos), greedy, with the
MIX of parameters plus penalties on 2 rows in 8 ("mixed"), and the same without the seed ("mixed-no-seed":
every sampled row on the candidate path), alternating (each variant first in turn), --repeats times; decode
tok/s = batch x (new - 1) / (generate time - that generate's own first engine step, the prompts' prefill),
thread CPU time; printed per repeat and as the median of the per-repeat ratios to greedy. (Until 2026-12-07
the prefill was a separate generate of the same prompts just before, which read ~50-130 ms slower for the
variant timed first after the previous repeat than that variant's own prefill step: greedy, always first,
got its decode time understated and the ratios came out 2-4% low.) Also per engine step: the median step time and the median time of its
StepSampler.sample (lm_head, processors, filters, draws, logprobs), and greedy's step with each variant's
sampling in its place (the forward is the same: less noise than whole-run tok/s on a shared machine).

Part 2 also runs on an older tree (the old sampler in the engine), e.g. the commit before moeserve/sample:
`git archive 22b2f4d | tar -x -C /tmp/old && cp benchmarks/sampling.py /tmp/old/benchmarks/ && cd /tmp/old &&
python benchmarks/sampling.py --decode-only` (a plain export; the script imports the tree it sits in).

Figures, never pass/fail. The machine may be shared: run it briefly (the defaults take about a minute for
part 1 and a few minutes for part 2) and read the spread.

Usage: python benchmarks/sampling.py [--vocab 32000] [--batches 1 8 32 64] [--logit-scale 3] [--repeats 7] [--threads 1]
           [--decode] [--decode-batch 32] [--new-tokens 32] [--prompt-len 64] [--eager]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeserve.sampling_params import SamplingParams  # noqa: E402
from tests.sample.reference import old_logprobs, old_sample  # noqa: E402

CLOCK = time.thread_time




class OldSampler:
    """BASELINE: the per-request sampler before moeserve/sample/ (moeserve/layers/sampler.py at commit 22b2f4d),
    whose code tests/sample/reference.py keeps as the spec the batched sampler reproduces; this is only its
    call shape (tokens, and logprobs skipped when no request asked, as the old code did)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits, params, generators):
        tokens = old_sample(logits, params, generators, self.generator)
        wants = any(p.logprobs is not None for p in params)
        return tokens, old_logprobs(logits, params, tokens) if wants else [None] * len(params)



MIX = [  # one request's parameters per row, cycling; a seed on 1 row in 8
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=50),
    dict(temperature=0.8, top_k=40, top_p=0.95, logprobs=5),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.0),
    dict(temperature=0.6, top_p=0.95, seed=1234),
    dict(temperature=0.9, top_p=0.9, min_p=0.02),
    dict(temperature=1.0, logprobs=1),
]
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)  # --decode: rows 1, 6


def mixed_params(batch: int, seeds: bool = True, penalties: bool = False) -> list[SamplingParams]:
    out = []
    for i in range(batch):
        kw = dict(MIX[i % len(MIX)])
        if "seed" in kw:
            kw["seed"] = kw["seed"] + i if seeds else None
        if penalties and i % len(MIX) in (1, 6):
            kw.update(PENALTIES)
        out.append(SamplingParams(**kw))
    return out


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:8.2f} ({100 * (min(xs) / med - 1):+.0f}/{100 * (max(xs) / med - 1):+.0f}%)"


def model_like_logits(batch: int, vocab: int, g: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(batch, vocab, generator=g) * scale).bfloat16().float()


def sampler_part(a) -> None:
    from moeserve.sample import Sampler  # here: part 2 alone also runs on a tree from before moeserve/sample

    g = torch.Generator().manual_seed(0)
    print(f"sampling per step: vocab {a.vocab}, float32 logits with bfloat16 values (randn x {a.logit_scale}), "
          f"{torch.get_num_threads()} "
          f"thread(s), thread CPU time, median of {a.repeats} (spread min..max)")
    print(f"{'batch':>5} {'old ms':>20} {'new ms':>20} {'old/new':>8} {'new, no seed ms':>20} {'old/new':>8}")
    for batch in a.batches:
        params = mixed_params(batch)
        logits = model_like_logits(batch, a.vocab, g, a.logit_scale)

        def gens():
            return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]

        want, _ = OldSampler(0)(logits, params, gens())
        got, _ = Sampler(0)(logits, params, gens())
        fixed = [i for i, p in enumerate(params) if p.seed is not None or p.greedy]
        if [want[i] for i in fixed] != [got[i] for i in fixed]:
            raise SystemExit(f"batch {batch}: seeded or greedy rows drew other tokens; not timing")
        unseeded = mixed_params(batch, seeds=False)
        old_s, new_s = OldSampler(0), Sampler(0)
        old_g, new_g = gens(), gens()
        runs = (("old", old_s, params, old_g), ("new", new_s, params, new_g),
                ("new, no seed", new_s, unseeded, [None] * batch))
        for _, s, ps, gs in runs:  # warm-up
            s(logits, ps, gs)
        times = {name: [] for name, *_ in runs}
        for _ in range(a.repeats):
            for name, s, ps, gs in runs:
                t0 = CLOCK()
                s(logits, ps, gs)
                times[name].append((CLOCK() - t0) * 1e3)
        ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
        ratio_ns = statistics.median(o / n for o, n in zip(times["old"], times["new, no seed"]))
        print(f"{batch:>5} {spread(times['old']):>20} {spread(times['new']):>20} {ratio:>7.1f}x "
              f"{spread(times['new, no seed']):>20} {ratio_ns:>7.1f}x", flush=True)


def decode_part(a) -> None:
    from benchmarks.decode_speed import prompts_of, v3_checkpoint
    from moeserve import LLM

    path = v3_checkpoint()
    b = a.decode_batch
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, max_num_seqs=b, max_num_batched_tokens=4096,
              enable_prefix_caching=False, enforce_eager=a.eager)

    def decoding(params):
        return [SamplingParams(**{**p.__dict__, "max_tokens": a.new_tokens, "ignore_eos": True}) for p in params]

    variants = {"greedy": decoding([SamplingParams(temperature=0)] * b),
                "mixed": decoding(mixed_params(b, penalties=True)),  # MIX + penalties, a seed on 1 row in 8
                "mixed-no-seed": decoding(mixed_params(b, seeds=False, penalties=True))}
    # per engine step (model runner execute) of the timed decodes: (step ms, of which StepSampler.sample ms),
    # thread CPU time: the forward is the same for every variant, so the steps' medians show the sampler's
    # share with less of the shared machine's noise than whole-run tok/s
    # and the sampler's minor page faults (fresh pages for its temporaries: ~1 us each, in the thread time)
    steps: dict[str, list[tuple[float, float, int]]] = {k: [] for k in variants}
    timing: list = [None, 0.0, 0]  # [variant being timed or None, sampler seconds, faults in this step]
    runner = llm.engine.runner
    execute, sample = runner.execute, runner.sampler.sample

    def faults() -> int:
        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt

    def timed_sample(*args, **kw):
        t0, f0 = CLOCK(), faults()
        try:
            return sample(*args, **kw)
        finally:
            timing[1] += CLOCK() - t0
            timing[2] += faults() - f0

    step_s: list[float] = []  # the engine steps of the generate being timed, seconds

    def timed_execute(out):
        timing[1], timing[2], t0 = 0.0, 0, CLOCK()
        result = execute(out)
        step_s.append(CLOCK() - t0)
        if timing[0] is not None:
            steps[timing[0]].append(((CLOCK() - t0) * 1e3, timing[1] * 1e3, timing[2]))
        return result

    runner.execute, runner.sampler.sample = timed_execute, timed_sample

    def tps(params, salt, name=None):
        prompts = prompts_of(b, a.prompt_len, salt)
        step_s.clear()
        timing[0], t0 = name, CLOCK()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        timing[0] = None
        # decode time: the generate's but its own first step (every prompt's prefill, which samples token 1)
        return b * (a.new_tokens - 1) / max(CLOCK() - t0 - step_s[0], 1e-9)

    for params in variants.values():  # warm-up
        tps(params, 0)
    runs: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:  # each variant first in turn
            runs[k].append(tps(variants[k], r + 1, k))
        print(f"repeat {r}: " + ", ".join(f"{k} {runs[k][-1]:7.1f} tok/s" for k in variants)
              + "".join(f", {k}/greedy {runs[k][-1] / runs['greedy'][-1]:.3f}" for k in variants if k != "greedy"),
              flush=True)
    print(f"batch {b} decode ({'eager' if a.eager else 'compiled'}), {a.new_tokens} new tokens, tok/s median "
          f"(spread): " + ", ".join(f"{k} {spread(v)}" for k, v in runs.items()))
    for k in variants:
        if k != "greedy":
            ratios = [m / g for m, g in zip(runs[k], runs["greedy"])]
            print(f"  {k}/greedy: median {statistics.median(ratios):.3f} (per repeat "
                  f"{', '.join(f'{x:.3f}' for x in ratios)})")
    step_ms = {k: statistics.median(t for t, _, _ in v) for k, v in steps.items()}
    sample_ms = {k: statistics.median(s for _, s, _ in v) for k, v in steps.items()}
    sample_pf = {k: statistics.median(f for _, _, f in v) for k, v in steps.items()}
    print(f"per engine step (median of {len(steps['greedy'])} steps, prefill steps included): "
          + ", ".join(f"{k} {step_ms[k]:.1f} ms of which sampling {sample_ms[k]:.1f} ms ({sample_pf[k]:.0f} page "
                      f"faults)" for k in variants))
    for k in variants:
        if k != "greedy":  # greedy's step with this variant's sampling in place of greedy's
            est = step_ms["greedy"] / (step_ms["greedy"] - sample_ms["greedy"] + sample_ms[k])
            print(f"  {k}/greedy from the step medians: {est:.3f} (sampling +{sample_ms[k] - sample_ms['greedy']:.1f} ms "
                  f"a step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--logit-scale", type=float, default=3.0,
                    help="part 1's logits: randn x this (0.5: flat rows like the random V3 checkpoint's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", action="store_true", help="also part 2: decode mixed vs greedy")
    ap.add_argument("--decode-only", action="store_true", help="only part 2")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="part 2 with --enforce-eager")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not a.decode_only:
        sampler_part(a)
    if a.decode or a.decode_only:
        decode_part(a)


if __name__ == "__main__":
    main()
