"""MTP speculative decoding: acceptance, tokens per step and decode tokens/s with vs without, same process.

Usage: python benchmarks/mtp_decode.py [--model PATH] [--batches 1 16] [--ks 1 2 3] [--new-tokens 64]
Model: the bundled trained model (moeserve/models/bundled/tiny-deepseek-v3) by default; prompts are 64-token
slices of its held-out files (the training script's rule: stdlib files with crc32(relpath) % 10 == 0).
Without a trained model it falls back to the random test checkpoint with a hand-made MTP layer and says so
(its acceptance rate means nothing). Greedy decoding, ignore_eos. Times are this thread's CPU time (one
torch thread; see CLOCK), wall-clock tok/s beside them. Per configuration it prints: acceptance
rate, per-position acceptance, tokens per request-step (1 + accepted drafts per verification), decode tokens/s and the ratio to the no-MTP baseline
at the same batch, and where a step's time goes: main model (forward + lm_head), MTP layer (all k
applications, its head and its batch preparation) and the rest (scheduler, batch/metadata preparation, verification, bookkeeping).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_LEN = 64
# CPU time of this thread (torch runs its ops on it with --threads 1): on a shared machine wall time also
# counts the time the OS gave the core to someone else, which swings 2x between runs.
CLOCK = time.thread_time


def pick_model(path: str | None) -> tuple[str, str]:
    from moeserve.models.default import BUNDLED

    if path:
        return path, "given"
    if os.path.isfile(os.path.join(BUNDLED, "config.json")):
        return BUNDLED, "bundled trained model"
    from tests.checkpoints import write_mtp_checkpoint
    cache = os.environ.get("MOESERVE_CACHE", os.path.expanduser("~/.cache/moeserve"))
    return write_mtp_checkpoint(os.path.join(cache, "bench-mtp-random")), "RANDOM test checkpoint (no trained model)"


def heldout_prompts(tokenizer, vocab: int, n: int) -> list[list[int]]:
    """64-token slices of held-out stdlib files; random ids when the tokenizer's vocab does not fit."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in {"site-packages", "dist-packages", "test", "tests",
                                                     "idle_test", "__pycache__"})
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if name.endswith(".py") and zlib.crc32(rel.encode()) % 10 == 0:
                files.append(os.path.join(dirpath, name))
    prompts = []
    for f in files:
        with open(f, errors="replace") as fh:
            ids = tokenizer.encode(fh.read())
        if len(ids) >= 4 * PROMPT_LEN and max(ids) < vocab:
            mid = len(ids) // 2  # past the license header / imports
            prompts.append(ids[mid: mid + PROMPT_LEN])
        if len(prompts) == n:
            return prompts
    g = torch.Generator().manual_seed(0)
    return prompts + [torch.randint(2, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n - len(prompts))]


class Timer:
    """Time (CLOCK) spent inside some modules' forward (forward pre/post hooks)."""

    def __init__(self, *modules) -> None:
        self.total, self._t = 0.0, 0.0
        self.handles = [h for m in modules for h in (m.register_forward_pre_hook(self._start),
                                                     m.register_forward_hook(self._stop))]

    def _start(self, *_):
        self._t = CLOCK()

    def _stop(self, *_):
        self.total += CLOCK() - self._t

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class MethodTimer:
    """Time (CLOCK) spent in one bound method of an object (the proposer's propose: layer, head and its prep)."""

    def __init__(self, obj, name: str, exclude: Timer | None = None) -> None:
        """exclude: a Timer whose modules the method also calls (the main lm_head, the MTP head's when shared):
        what it counts during the method stays the method's."""
        self.total, self.obj, self.name = 0.0, obj, name
        self.own = vars(obj).get(name)  # an instance's own wrapper (own_metadata), kept on remove()
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t, outer = CLOCK(), exclude.total if exclude else 0.0
            try:
                return inner(*a, **kw)
            finally:
                self.total += CLOCK() - t
                if exclude:
                    exclude.total = outer
        setattr(obj, name, timed)

    def remove(self) -> None:
        if self.own is None:
            delattr(self.obj, self.name)  # back to the class's method
        else:
            setattr(self.obj, self.name, self.own)


def as_before(llm):
    """The proposer as before 2026-12-08: its first pass without the main step's metadata (step=None: its own,
    over the valid rows), and its own copy of a head the checkpoint repeats (an nn.Linear in the model dtype)."""
    proposer = llm.engine.runner.proposer
    propose = proposer.propose
    proposer.propose = lambda out, hidden, sampled, step=None: propose(out, hidden, sampled)
    shared, main = proposer.mtp.layer.shared_head, proposer.main.lm_head
    if shared.head is None and main.weight.is_floating_point():
        shared.head = torch.nn.Linear(main.in_features, main.out_features, bias=False, dtype=main.weight.dtype)
        shared.head.weight.data.copy_(main.weight.data)
    return llm


def ratio_spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"x{xs[len(xs) // 2]:.3f} ({xs[0]:.3f}-{xs[-1]:.3f})"


def run(llm, groups: list[list[list[int]]], new_tokens: int) -> dict:
    """Decode phase of each group of prompts in turn (a group = one batch): requests are prefilled (first
    token out) before the clock starts. Every batch size covers the same prompts."""
    eng = llm.engine
    main = Timer(eng.runner.model, eng.runner.model.lm_head)
    mtp = MethodTimer(eng.runner.proposer, "propose", exclude=main) if eng.runner.proposer else None
    before = eng.stats()
    tokens = steps = 0
    wall = cpu = 0.0
    model_s = mtp_s = 0.0
    for prompts in groups:
        _prefill(eng, prompts, new_tokens)
        m0, p0 = main.total, (mtp.total if mtp else 0.0)
        t, n, w, c = _decode(eng)
        tokens, steps, wall, cpu = tokens + t, steps + n, wall + w, cpu + c
        model_s, mtp_s = model_s + main.total - m0, mtp_s + (mtp.total - p0 if mtp else 0.0)
    after = eng.stats()
    main.remove()
    if mtp:
        mtp.remove()
    verifications = after.spec_num_drafts - before.spec_num_drafts
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    acc = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [(a - a0) / max(d - d0, 1) for a, a0, d, d0 in zip(
        after.spec_accepted_per_position, before.spec_accepted_per_position or [0] * 8,
        after.spec_drafts_per_position, before.spec_drafts_per_position or [0] * 8)]
    return {"tokens": tokens, "steps": steps, "tok_s": tokens / cpu, "wall_tok_s": tokens / wall,
            # tokens a request gets per step it verifies drafts in (1 without MTP)
            "tokens_per_req_step": 1 + acc / verifications if verifications else 1.0,
            "acceptance": acc / drafts if drafts else None, "per_position": [round(x, 3) for x in per_pos],
            "ms_step": 1e3 * cpu / steps, "ms_main": 1e3 * model_s / steps, "ms_mtp": 1e3 * mtp_s / steps,
            "ms_other": 1e3 * (cpu - model_s - mtp_s) / steps}


def _prefill(eng, prompts: list[list[int]], new_tokens: int) -> None:
    """Add one batch and step until every request has its first token."""
    from moeserve.protocol import EngineCoreRequest
    from moeserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(EngineCoreRequest(f"b{time.monotonic_ns()}-{i}", p, params))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()


def _decode(eng) -> tuple[int, int, float, float]:
    """(tokens, steps, wall s, cpu s) of the decode phase of the running batch."""
    tokens, steps, wall, cpu = 0, 0, 0.0, 0.0
    while eng.has_unfinished():
        t, c = time.perf_counter(), CLOCK()
        outs = eng.step()
        wall += time.perf_counter() - t
        cpu += CLOCK() - c
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens, steps, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", action="store_true",
                    help="also run each k as the proposer ran before 2026-12-08: its first pass on metadata of its "
                         "own over the valid rows (still so under --enable-dbo), and a head of its own where the "
                         "checkpoint repeats lm_head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moeserve import LLM

    path, label = pick_model(args.model)
    print(f"model: {path} ({label}); dtype {args.dtype}, {args.threads} thread(s), greedy, "
          f"{max(args.batches)} {PROMPT_LEN}-token held-out prompts at every batch size, {args.new_tokens} new tokens")
    engines = {0: LLM(path, dtype=args.dtype, enable_prefix_caching=False)}  # the same prompts run again: measure compute, not the prefix cache
    for k in args.ks:
        engines[k] = LLM(path, dtype=args.dtype, enable_prefix_caching=False, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        if args.before:
            engines[f"{k} bef"] = as_before(LLM(path, dtype=args.dtype, enable_prefix_caching=False,
                                                speculative_config={"method": "mtp", "num_speculative_tokens": k}))
    n = max(args.batches)
    prompts = heldout_prompts(engines[0].tokenizer, engines[0].arch.vocab_size, n)
    for llm in engines.values():  # warm-up
        run(llm, [prompts[:2]], 8)
    rows = []
    for b in args.batches:
        # Repeats interleave the configurations (the machine is shared: load drifts between runs) and the
        # best run of each counts (the least disturbed one).
        reps = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, llm in engines.items():
                groups = [prompts[i: i + b] for i in range(0, n - b + 1, b)]  # all n prompts, b at a time
                reps[k].append(run(llm, groups, args.new_tokens))
        base = max(reps[0], key=lambda x: x["tok_s"])["tok_s"]
        for k in engines:
            r = {"batch": b, "k": k, **max(reps[k], key=lambda x: x["tok_s"])}
            r["speedup"] = r["tok_s"] / base
            rows.append(r)
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f} {r['per_position']}"
            print(f"batch {b:3d} k={k!s:5}: {r['tok_s']:8.1f} tok/s (wall {r['wall_tok_s']:6.1f})  x{r['speedup']:.2f}  "
                  f"tokens/req-step {r['tokens_per_req_step']:.2f}  acceptance {acc}  step {r['ms_step']:.2f} ms "
                  f"= main {r['ms_main']:.2f} + mtp {r['ms_mtp']:.2f} + other {r['ms_other']:.2f}")
        for k in args.ks if args.before else []:  # paired: repeat i of one over repeat i of the other
            pairs = list(zip(reps[k], reps[f"{k} bef"]))
            print(f"batch {b:3d} k={k} / k={k} bef: tok/s {ratio_spread([x['tok_s'] / y['tok_s'] for x, y in pairs])}, "
                  f"MTP ms {ratio_spread([x['ms_mtp'] / y['ms_mtp'] for x, y in pairs])} (median of "
                  f"{len(pairs)} repeats, min-max)")
    print(json.dumps({"model": label, "rows": rows}))


if __name__ == "__main__":
    main()
