"""Absorbed MLA decode attention per layer (layers/attention/mla.py `_decode`'s core) at decode batch sizes and
context lengths, on DeepSeek-V3's latent dims (kv_lora 512 + rope 64, 16 heads as in benchmarks/decode_speed.py).

Usage: python benchmarks/mla_decode.py [--batches 1 8 32] [--contexts 128 1024] [--repeats 5] [--threads 1]
                                       [--variants bmm sdpa bmm_t flex inductor paged kernel kvcache]
       python benchmarks/mla_decode.py --engine [--prompt-lens 128 960] [--engine-batch 32] [--engine-steps 16]
                                       [--rounds 3] [--everywhere]

Variants, compared in one run on the same inputs:
- bmm: two bmm's (scores, then the value product over all C + dr columns, the output sliced) around an eager
  float32 softmax (what mla.py did from 2026-12-06 to 2026-12-07);
- sdpa: SDPA's flash kernel with each row's heads as the queries of one KV head (what mla.py does now; the
  baseline of the ratios);
- bmm_t: the scores as context @ query^T, so the context is the GEMM's row operand (read as stored, no
  reorder for AMX's tiles), transposed to [B, H, L] in float32 for the softmax, the value product as in bmm;
- flex: torch.compile'd flex_attention (inductor's C++ template on CPU) in sdpa's layout, the lengths as a
  block mask built outside the timing (an engine would build it once per step); compiles once per shape;
- inductor: bmm_t's scores compiled with max-autotune, whose C++ GEMM template (AMX micro-kernel) takes the
  float conversion, mask and scale as an epilogue on its float32 accumulators (scores in float32, where
  oneDNN's bmm rounds them to BF16), a compiled softmax, oneDNN's value product; compiles once per shape;
- paged: sdpa with its context first gathered from a paged cache (16-token blocks at shuffled block ids, as
  an engine's pool hands them out) into a reused buffer, stale slots cleared: mla.py's whole standard path
  (gather_decode_context + SDPA), the baseline of the two kernels below, which read that cache in place;
- kernel: vLLM's CPU library's `decode_attention_cpu` (sgl-kernel's CPU decode attention) over the paged
  cache, a per-token slot table (layers/attention/mla_kernel.py, what mla.py runs with MOESERVE_MLA_KERNEL);
- kvcache: the library's `mla_decode_kvcache` (vLLM's reference CPU MLA decode, 16-token blocks only) over
  the same cache and a block table.
The paged variants need vLLM's CPU kernel library for the kernels (layers/cpu_kernels.py).

Each (batch, context) gets 8 layers' worth of contexts (one set of lengths and, for the paged variants, one
block table and scratch buffer for all, as in a decode step), cycled so that every call reads its KV from
memory, as a decode step does; the variants' order alternates between repeats. Per variant: milliseconds per
layer (median of --repeats, CPU time of this thread, [min-max]), its largest error against a float32 reference on
the first layer's inputs, its ratio to sdpa (for the kernels also to paged); for sdpa also the FLOP rate and
KV read rate its time implies (the scores and the value product are 2 x B x H x L x (C + dr) multiply-adds
each; the gather of the context from the paged cache is left out of all but paged).

--engine: the whole decode step instead, with mla.py's kernel path (layers/attention/mla_kernel.py) off and on
in one engine (MOESERVE_MLA_KERNEL, read per call): benchmarks/decode_speed.py's checkpoint, BF16, decode
through the compiled graphs, prefix caching on; per prompt length, --engine-batch prompts generate
max_tokens=1 twice (the second prefix-cached), then 1 + --engine-steps; a step = the difference / steps, CPU
time of this thread (docs/engine.md's long-context method). Each (length, kernel) once as a warm-up, then
--rounds rounds with the order reversed every other round. Prints each round, the medians, kernel off / on
per length, and each length's extra over the shortest. --everywhere: the kernel at every decode batch (its
MIN_SLOTS threshold lifted), to measure where it should run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, C, R = 16, 512, 64


SCALE = 0.1


def attend_bmm(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    scores = torch.bmm(q_full, kv.transpose(1, 2)).float() * SCALE
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    return torch.bmm(probs, kv)[..., :C]


def attend_sdpa(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    kv = kv[:, None]
    o = F.scaled_dot_product_attention(q_full[:, None], kv, kv, attn_mask=~mask[:, None, None, :], scale=SCALE)
    return o[:, 0, :, :C]


def attend_bmm_t(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    scores = torch.bmm(kv, q_full.transpose(1, 2)).transpose(1, 2).float()  # [B, H, L], contiguous float32
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = (scores * SCALE).softmax(dim=-1).to(kv.dtype)
    return torch.bmm(probs, kv)[..., :C]


_flex = None


def flex_mask(mask: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    b, length = mask.shape
    return create_block_mask(lambda bi, h, qi, ki: ~mask[bi, ki], b, 1, HEADS, length, device="cpu")


def attend_flex(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 64  # one graph per (batch, context)
        _flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    kv = kv[:, None]
    return _flex(q_full[:, None], kv, kv, block_mask=prep, scale=SCALE)[:, 0, :, :C]


_inductor = None


def attend_inductor(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    global _inductor
    if _inductor is None:
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"  # its AMX GEMM template against oneDNN's bmm
        torch._dynamo.config.recompile_limit = 64

        def scores(q_full, kv, mask):  # the template's epilogue sees the float32 accumulators
            s = torch.bmm(kv, q_full.transpose(1, 2)).float()  # [B, L, H]
            return s.masked_fill(mask[:, :, None], float("-inf")) * SCALE

        def probs(s):
            return s.softmax(dim=1).to(torch.bfloat16).transpose(1, 2).contiguous()

        _inductor = [torch.compile(f, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs")
                     for f in (scores, probs)]
    return torch.bmm(_inductor[1](_inductor[0](q_full, kv, mask)), kv)[..., :C]


BLOCK = 16  # the paged variants' block size (the engine's default --block-size)


class Paged:
    """One layer's contexts as an engine's paged cache: 16-token blocks at shuffled block ids. As in a decode
    step, the block table, the lengths and the metadata mla.py builds from them (DecodeBatch: the stale slots'
    flat positions, the per-token slot table, the one context buffer every layer gathers into) are the same
    for every layer: `batch` is the first layer's, handed to the others."""

    def __init__(self, kv: torch.Tensor, mask: torch.Tensor, g: torch.Generator, first: "Paged | None") -> None:
        from moeserve.layers.attention.metadata import _decode_batch

        b, length, width = kv.shape
        per_seq = -(-length // BLOCK)
        blocks = F.pad(kv, (0, 0, 0, per_seq * BLOCK - length)).view(b * per_seq, BLOCK, width)
        order = torch.randperm(b * per_seq, generator=g) if first is None else first.order
        self.order = order
        self.cache = torch.empty_like(blocks)
        self.cache[order] = blocks  # block j of sequence i lives at order[i * per_seq + j]
        lens = (~mask).sum(dim=1)
        table = order.view(b, per_seq)
        self.batch = (_decode_batch(list(range(b)), table.tolist(), lens.tolist(), BLOCK) if first is None
                      else first.batch)
        self.block_table32 = table.to(torch.int32)
        self.lens32 = lens.to(torch.int32)


def attend_paged(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    from moeserve.layers.attention.kv_dtype import gather_decode_context

    d = prep.batch
    return attend_sdpa(q_full, gather_decode_context(prep.cache, d, q_full.dtype), d.mask)


def attend_kernel(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    from moeserve.layers.attention import mla_kernel

    return mla_kernel.decode_latent(q_full, prep.cache, prep.batch, SCALE, C)


def attend_kvcache(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, prep=None) -> torch.Tensor:
    out = q_full.new_empty(q_full.shape[0], HEADS, C)
    torch.ops._C.mla_decode_kvcache(out, q_full, prep.cache, SCALE, prep.block_table32, prep.lens32)
    return out


VARIANTS = {"bmm": attend_bmm, "sdpa": attend_sdpa, "bmm_t": attend_bmm_t, "flex": attend_flex,
            "inductor": attend_inductor, "paged": attend_paged, "kernel": attend_kernel, "kvcache": attend_kvcache}
PAGED = ("paged", "kernel", "kvcache")  # read the layer's Paged cache (one per layer, shared by them)
PREPARE = {"flex": flex_mask}  # per-layer inputs built outside the timing


def reference(q_full: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return attend_bmm(q_full.float(), kv.float(), mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["bmm", "sdpa", "bmm_t"], choices=list(VARIANTS))
    ap.add_argument("--engine", action="store_true", help="the whole decode step, mla.py's kernel off and on")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 960])
    ap.add_argument("--engine-batch", type=int, default=32)
    ap.add_argument("--engine-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--everywhere", action="store_true", help="--engine: the kernel at every decode batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        with torch.inference_mode(False):  # the engine builds its model outside it, as an LLM user's would
            return engine_steps(args)
    names = list(dict.fromkeys(["sdpa"] + args.variants))  # sdpa always: the ratios' baseline
    if any(n in PAGED for n in names):  # the kernels' baseline: the same paged cache gathered for SDPA
        if "paged" not in names:
            names.insert(1, "paged")
        from moeserve.layers import cpu_kernels
        missing = [n for n, op in (("kernel", "decode_attention_cpu"), ("kvcache", "mla_decode_kvcache"))
                   if n in names and not cpu_kernels.has(op)]
        if missing:
            raise SystemExit(f"{', '.join(missing)}: vLLM's CPU kernel library is not loaded "
                             "(moeserve/layers/cpu_kernels.py)")
    g = torch.Generator().manual_seed(0)
    pg = torch.Generator().manual_seed(1)  # the paged caches' block order (the other inputs as without them)
    for b in args.batches:
        for length in args.contexts:
            layers = []
            lens = torch.randint(max(1, length - 16), length + 1, (b,), generator=g)  # every layer's, as in a step
            mask = torch.arange(length)[None, :] >= lens[:, None]
            for _ in range(8):
                kv = torch.randn(b, length, C + R, generator=g).to(torch.bfloat16)
                q = torch.randn(b, HEADS, C + R, generator=g).to(torch.bfloat16)
                layers.append((q, kv, mask))
            paged = None
            if any(n in PAGED for n in names):
                paged = []
                for _, kv, mask in layers:
                    paged.append(Paged(kv, mask, pg, paged[0] if paged else None))
            preps = {n: paged if n in PAGED else [PREPARE[n](mask) if n in PREPARE else None
                                                  for _, _, mask in layers] for n in names}
            exact = reference(*layers[0])
            errs = {n: (VARIANTS[n](*layers[0], preps[n][0]).float() - exact).abs().max().item() for n in names}
            runs: dict[str, list[float]] = {n: [] for n in names}
            for r in range(args.repeats):
                for n in names if r % 2 == 0 else names[::-1]:
                    t0 = time.thread_time()
                    for args_, prep in zip(layers, preps[n]):
                        VARIANTS[n](*args_, prep)
                    runs[n].append((time.thread_time() - t0) / len(layers) * 1e3)
            ms = {n: statistics.median(v) for n, v in runs.items()}
            flops = 2 * 2 * b * HEADS * length * (C + R)
            kv_bytes = b * length * (C + R) * 2
            print(f"batch {b} x context {length}: sdpa {flops / ms['sdpa'] / 1e6:.1f} GFLOP/s, "
                  f"{kv_bytes / ms['sdpa'] / 1e6:.1f} GB/s of KV", flush=True)
            for n in names:
                of_paged = f"  x{ms['paged'] / ms[n]:5.2f} of paged" if n in PAGED[1:] else ""
                print(f"  {n:8s} {ms[n]:8.2f} ms [{min(runs[n]):.2f}-{max(runs[n]):.2f}]  x{ms['sdpa'] / ms[n]:5.2f} "
                      f"of sdpa  err {errs[n]:.1e}{of_paged}", flush=True)


def engine_steps(args) -> None:
    """--engine (see the module docstring)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.decode_speed import prompts_of, v3_checkpoint
    from moeserve import LLM, SamplingParams
    from moeserve.layers.attention import mla_kernel

    calls = [0]
    real = mla_kernel.decode_latent

    def counted(*a):
        calls[0] += 1
        return real(*a)

    mla_kernel.decode_latent = counted
    if args.everywhere:
        mla_kernel.MIN_SLOTS = 0
    llm = LLM(v3_checkpoint(), dtype="bfloat16", max_model_len=max(args.prompt_lens) + args.engine_steps + 16,
              max_num_seqs=args.engine_batch, enable_prefix_caching=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=args.engine_steps + 1, ignore_eos=True)

    def step_ms(length: int, kernel: str) -> tuple[float, int]:
        os.environ[mla_kernel.ENV] = kernel
        prompts = prompts_of(args.engine_batch, length, salt=length)
        llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)  # cached from here on
        t0 = time.thread_time()
        llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)
        pre = time.thread_time() - t0
        calls[0] = 0
        t0 = time.thread_time()
        llm.generate(prompt_token_ids=prompts, sampling_params=full, use_tqdm=False)
        return (time.thread_time() - t0 - pre) / args.engine_steps * 1e3, calls[0]

    cases = [(length, k) for length in args.prompt_lens for k in ("0", "1")]
    for case in cases:
        step_ms(*case)
    runs: dict = {c: [] for c in cases}
    for r in range(args.rounds):
        line = []
        for case in cases if r % 2 == 0 else cases[::-1]:
            ms, n = step_ms(*case)
            runs[case].append(ms)
            line.append(f"{case[0]} kernel {'on' if case[1] == '1' else 'off'} {ms:.1f} ms ({n} kernel calls)")
        print(f"round {r}: " + ", ".join(line), flush=True)
    med = {c: statistics.median(v) for c, v in runs.items()}
    base = min(args.prompt_lens)
    for length in args.prompt_lens:
        off, on = med[(length, "0")], med[(length, "1")]
        extra = "" if length == base else (f"; over {base} tokens: off +{off - med[(base, '0')]:.1f} ms, "
                                           f"on +{on - med[(base, '1')]:.1f} ms")
        print(f"prompts of {length}, batch {args.engine_batch}: step kernel off {off:.1f} ms, on {on:.1f} ms "
              f"(x{off / on:.2f}){extra}", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
