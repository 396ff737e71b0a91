"""Decode and prefill speed against the machine's limit: BF16 and A8W8, optionally vLLM CPU beside them.

Usage: python benchmarks/decode_speed.py [--batches 1 8 32 64] [--prompt-len 128] [--new-tokens 64]
           [--prefill-prompts 8] [--repeats 3] [--threads 1] [--tp 1] [--modes bf16 a8w8 bf16-eager a8w8-eager]
           [--startup] [--peer vllm --vllm-python /work/vllm-venv/bin/python [--vllm-extra-path DIR]] [--json FILE]

Modes: bf16 / a8w8 run decode through the compiled graphs (engine/compiled_decode.py); the -eager modes are
the same engines with --enforce-eager, the baseline of the same run. --startup also times engine start-up in
fresh processes: first start (empty compile cache), a later start (the cache it left), and eager.

Model: a random checkpoint with DeepSeek-V3's real MLA dims shrunk in depth and width (hidden 1024, 8 layers,
the first dense, 16 heads, q_lora 384, kv_lora 512, nope 128, rope 64, v 128, 64 routed experts top-6 in 8
groups, 2 shared, moe_intermediate 256, vocab 32000), written once with transformers, config.json spelled
like a real V3 (scoring_func sigmoid, topk_method noaux_tc).

Per mode and batch: decode tok/s = batch x (new - 1) / (time of the full generate - time of the same
prefill alone), each figure the median of --repeats runs (modes alternate, their order reversed every other repeat), with the spread (min..max as %
of the median). Prefill tok/s: --prefill-prompts prompts of --prompt-len tokens, max_tokens 1. Also: the
machine's read bandwidth (float32 sum of 512 MB), the weight bytes one token reads (active parameters), the
batch-1 roofline (bandwidth / bytes per token) and the fraction reached, and a batch-1 decode step split by
phase (the engine's timers: attention, router, shared experts, experts; the rest is norms, embedding, lm_head,
sampling, scheduling and batch preparation).

Time is this thread's CPU time (torch ops run on it with --threads 1): on a shared machine wall time also
counts other jobs. --peer vllm runs vLLM's CPU build on the same checkpoint and prompts in a subprocess of
its own venv (install: docs/engine.md); its engine is other processes, so then both sides are timed in wall
time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The engines of this process share oneDNN's primitive cache (one per process, 1024 GEMM shapes by default,
# each expert row count a shape of its own): together the BF16 and A8W8 engines' shapes overflowed it, so each
# prefill rebuilt what the other had evicted (prefill measured ~30% low, spreads of +-20%). A serving process
# holds one engine: this gives each engine here the room it has alone. oneDNN reads it once, at its first
# primitive, so before any op. vLLM's process keeps its default.
SET_ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import BENCH_CONFIG, bench_checkpoint, memory_bandwidth_gbs, param_counts  # noqa: E402

V3_CONFIG = dict(BENCH_CONFIG, kv_lora_rank=512, scoring_func="sigmoid", topk_method="noaux_tc",
                 norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096)
CLOCK = time.thread_time


def v3_checkpoint() -> str:
    cache = os.environ.get("MOESERVE_CACHE", os.path.expanduser("~/.cache/moeserve"))
    path = bench_checkpoint(os.path.join(cache, "bench-v3-1024h-8l"), V3_CONFIG)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    want = {k: V3_CONFIG[k] for k in ("scoring_func", "topk_method", "n_group", "topk_group")}
    if any(cfg.get(k) != v for k, v in want.items()):  # transformers may drop keys its config does not know
        cfg.update(want)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return path


def prompts_of(batch: int, prompt_len: int, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * salt + j) % 31000 + 2 for j in range(prompt_len)] for i in range(batch)]


def decode_tps(llm, batch: int, prompt_len: int, new_tokens: int, salt: int) -> float:
    from moeserve import SamplingParams

    prompts = prompts_of(batch, prompt_len, salt)
    one = SamplingParams(temperature=0, max_tokens=1)
    t0 = CLOCK()
    llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)
    prefill = CLOCK() - t0
    t0 = CLOCK()
    llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    decode = CLOCK() - t0 - prefill
    if decode <= 0:  # the prefill alone took longer than prefill + decode: a disturbed run, not a figure
        print(f"batch {batch}: a repeat timed the prefill alone longer than the whole run; dropped "
              "(a NaN among its runs)", flush=True)
        return float("nan")
    return batch * (new_tokens - 1) / decode


def prefill_tps(llm, prompts: int, prompt_len: int, salt: int) -> float:
    from moeserve import SamplingParams

    t0 = CLOCK()
    llm.generate(prompt_token_ids=prompts_of(prompts, prompt_len, salt), use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=1))
    return prompts * prompt_len / max(CLOCK() - t0, 1e-9)


def phase_split(llm, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Milliseconds per batch-1 decode step by phase (the engine's wall-time timers), and the whole step:
    (the full generate - the same prefill alone) / (new_tokens - 1), phase by phase."""
    from moeserve import SamplingParams
    from moeserve.distributed.comm import STATS

    prompts = prompts_of(1, prompt_len, 99)

    def timed_run(n: int) -> tuple[dict, float]:
        STATS.reset()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return dict(STATS.reset().seconds), time.perf_counter() - t0

    timed_run(1)  # warm-up
    pre, pre_total = timed_run(1)
    full, total = timed_run(new_tokens)
    steps = new_tokens - 1
    split = {k: (v - pre.get(k, 0.0)) / steps * 1e3 for k, v in full.items()}
    split["step"] = (total - pre_total) / steps * 1e3
    split["other"] = split["step"] - sum(v for k, v in split.items() if k != "step")
    return split


def cpu_description() -> str:
    """The CPU and the kernels it gets, since the ratios depend on them: AMX (oneDNN's BF16 / INT8 tiles,
    Intel) and zentorch (AMD's kernels, the routed experts and A8W8 linears on AMD CPUs)."""
    from moeserve.layers.moe import zen

    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    amx = "AMX" if torch.cpu._is_amx_tile_supported() else "no AMX"
    return f"{name}; {amx}; zentorch {'on' if zen.available() else 'off'}"


def bytes_per_token(cfg: dict, mode: str, context: int) -> float:
    """Bytes one batch-1 decode step reads: the weights it uses (INT8 ones at one byte with --quantization
    a8w8, lm_head included; the absorbed MLA matrices and the float32 router stay as they are) and the latent KV of
    `context` tokens. The embedding table contributes one row."""
    w = 1 if mode == "a8w8" else 2
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kv_dim = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    attn = w * (h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qk + h * kv_dim
                + heads * cfg["v_head_dim"] * h)
    absorbed = 2 * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) * cfg["kv_lora_rank"]
    dense, moe = cfg["first_k_dense_replace"], layers - cfg["first_k_dense_replace"]
    mlp = dense * w * 3 * h * cfg["intermediate_size"] + moe * (
        w * (cfg["num_experts_per_tok"] + cfg["n_shared_experts"]) * 3 * h * cfg["moe_intermediate_size"]
        + 4 * cfg["n_routed_experts"] * h)
    kv = layers * context * kv_dim * 2
    return layers * (attn + absorbed) + mlp + w * cfg["vocab_size"] * h + 2 * h + kv


def weight_memory(llm) -> dict:
    """Bytes the engine holds for weights: its parameters (INT8 ones at one byte) and the oneDNN-packed copies
    made at load beside them (BF16 linears and experts; INT8 weights where packing pays)."""
    from moeserve.device_memory import module_bytes
    from moeserve.layers.linear import packed_copy_bytes

    runner = getattr(llm.engine, "runner", None)
    if runner is None:  # ranks in other processes (--tp): not measured from here
        return dict(parameters=float("nan"), packed_copies=float("nan"))
    return dict(parameters=module_bytes(runner.model), packed_copies=packed_copy_bytes(runner.model))


def spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x == x] or [float("nan")]  # dropped (NaN) repeats left out
    med = statistics.median(xs)
    return dict(median=med, lo_pct=100 * (min(xs) / med - 1), hi_pct=100 * (max(xs) / med - 1), runs=xs)


MODES = ("bf16", "a8w8", "bf16-eager", "a8w8-eager")  # -eager: --enforce-eager (no compiled decode graphs)


def engine_kwargs(mode: str, args) -> dict:
    return dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=max(args.batches + [args.prefill_prompts]),
                max_num_batched_tokens=max(4096, args.prefill_prompts * args.prompt_len),
                enable_prefix_caching=False,  # the same prompts run again: measure compute, not the cache
                quantization="a8w8" if mode.startswith("a8w8") else None, enforce_eager=mode.endswith("-eager"),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def run_moeserve(path: str, args) -> dict:
    from moeserve import LLM, SamplingParams

    llms, start_s = {}, {}
    weights = {}
    for m in args.modes:
        t0 = time.perf_counter()
        llms[m] = LLM(path, **engine_kwargs(m, args))
        start_s[m] = time.perf_counter() - t0
        weights[m] = weight_memory(llms[m])
        print(f"{m}: engine ready in {start_s[m]:.1f} s; weights {weights[m]['parameters'] / 1e6:.0f} MB + "
              f"packed copies {weights[m]['packed_copies'] / 1e6:.0f} MB", flush=True)
    for llm in llms.values():  # warm-up: every batch size once (allocator, oneDNN primitives), untimed
        for b in args.batches:
            llm.generate(prompt_token_ids=prompts_of(b, args.prompt_len, 0), use_tqdm=False,
                         sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        # Prefill three times: oneDNN makes a primitive per GEMM shape, and each prefill's experts see row
        # counts the last did not (~1.4 ms a new BF16 shape, ~0.5 ms INT8, one thread): after one warm-up
        # the first timed BF16 prefill still ran ~20% below the next ones
        for salt in range(3):
            prefill_tps(llm, args.prefill_prompts, args.prompt_len, salt=salt)
    res: dict = {m: {"decode": {}, "prefill": None, "start_s": start_s[m], "weight_bytes": weights[m]} for m in llms}
    for b in args.batches:
        runs = {m: [] for m in llms}
        for r in range(args.repeats):
            for m, llm in in_turn(llms, r):
                runs[m].append(decode_tps(llm, b, args.prompt_len, args.new_tokens, salt=r + 1))
        for m in llms:
            res[m]["decode"][b] = spread(runs[m])
        print("batch %3d: " % b + "  ".join(f"{m} {res[m]['decode'][b]['median']:8.1f} tok/s "
                                           f"({res[m]['decode'][b]['lo_pct']:+.0f}/{res[m]['decode'][b]['hi_pct']:+.0f}%)"
                                           for m in llms), flush=True)
    runs = {m: [] for m in llms}
    for r in range(args.repeats):
        for m, llm in in_turn(llms, r):
            runs[m].append(prefill_tps(llm, args.prefill_prompts, args.prompt_len, salt=100 + r))
    for m in llms:
        res[m]["prefill"] = spread(runs[m])
        res[m]["phases_batch1_ms"] = phase_split(llms[m], args.prompt_len, args.new_tokens)
    print("prefill:   " + "  ".join(f"{m} {res[m]['prefill']['median']:8.1f} tok/s "
                                    f"({res[m]['prefill']['lo_pct']:+.0f}/{res[m]['prefill']['hi_pct']:+.0f}%)"
                                    for m in llms), flush=True)
    return res


def in_turn(llms: dict, r: int) -> list:
    """The engines in order for repeat r, reversed every other repeat: an engine timed right after another
    finds a different cache (a second run of the same engine here was ~18% faster from cache warmth alone)."""
    order = list(llms.items())
    return order if r % 2 == 0 else order[::-1]


VLLM_SCRIPT = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    a = json.loads(sys.argv[1])
    # on CPU gpu_memory_utilization is the share of host memory vLLM reserves (weights + KV): a small one
    llm = LLM(a["path"], dtype="bfloat16", max_model_len=1024, seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=a["memory_fraction"],
              max_num_seqs=max(a["batches"] + [a["prefill_prompts"]]),
              max_num_batched_tokens=max(4096, a["prefill_prompts"] * a["prompt_len"]))

    def prompts(b, salt):
        return [TokensPrompt(prompt_token_ids=[(7 * i + 13 * salt + j) % 31000 + 2 for j in range(a["prompt_len"])])
                for i in range(b)]

    def gen(b, n, salt):
        t = time.perf_counter()
        llm.generate(prompts(b, salt), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    out = {"decode": {}, "prefill": []}
    for b in a["batches"]:
        gen(b, 4, 0)
        runs = []
        for r in range(a["repeats"]):
            pre = gen(b, 1, r + 1)
            runs.append(b * (a["new_tokens"] - 1) / max(gen(b, a["new_tokens"], r + 1) - pre, 1e-9))
        out["decode"][b] = runs
    for r in range(a["repeats"]):
        out["prefill"].append(a["prefill_prompts"] * a["prompt_len"] / gen(a["prefill_prompts"], 1, 100 + r))
    from vllm.platforms import current_platform
    out["platform"] = type(current_platform).__name__  # ZenCpuPlatform where zentorch is on its path
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core by spawn, which imports this file again
    main()
"""


def run_vllm(path: str, args) -> dict | None:
    spec = dict(path=path, batches=args.batches, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                prefill_prompts=args.prefill_prompts, repeats=args.repeats, memory_fraction=args.vllm_memory_fraction)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else "all",
               OMP_NUM_THREADS=str(args.threads), VLLM_TARGET_DEVICE="cpu")
    env.pop("PYTHONPATH", None)
    if SET_ONEDNN_CACHE:
        env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    if args.vllm_extra_path:  # e.g. zentorch, with which vLLM picks its ZenCpuPlatform on an AMD CPU
        env["PYTHONPATH"] = args.vllm_extra_path
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "vllm_peer.py")
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT)
        proc = subprocess.run([args.vllm_python, script, json.dumps(spec)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            raw = json.loads(line[len("VLLM_RESULT "):])
            res = {"decode": {int(b): spread(r) for b, r in raw["decode"].items()}, "prefill": spread(raw["prefill"]),
                   "platform": raw.get("platform")}
            print(f"vllm platform: {res['platform']}", flush=True)
            for b in args.batches:
                print(f"vllm batch {b:3d}: {res['decode'][b]['median']:8.1f} tok/s", flush=True)
            print(f"vllm prefill: {res['prefill']['median']:8.1f} tok/s", flush=True)
            return res
    print("vLLM peer failed (exit %d):\n%s" % (proc.returncode, proc.stderr[-8000:]), flush=True)
    return None


def report(res: dict, peer: dict | None, args) -> dict:
    counts = param_counts(V3_CONFIG)
    bw = memory_bandwidth_gbs()
    context = args.prompt_len + args.new_tokens // 2
    bytes_tok = {m: bytes_per_token(V3_CONFIG, m.split("-")[0], context) for m in MODES}
    out = {"bandwidth_GBs": bw, "active_params_M": counts["active"] / 1e6, "threads": torch.get_num_threads(),
           "bytes_per_token": bytes_tok, "moeserve": res, "vllm": peer}
    out["cpu"] = cpu_description()
    print(f"\ncpu: {out['cpu']}")
    print(f"read bandwidth {bw:.1f} GB/s; a batch-1 step reads {bytes_tok['bf16'] / 1e6:.0f} MB (BF16), "
          f"{bytes_tok['a8w8'] / 1e6:.0f} MB (A8W8: the absorbed MLA matrices stay BF16)")
    for m, r in res.items():
        if 1 in r["decode"]:
            roof = bw * 1e9 / bytes_tok[m]
            frac = r["decode"][1]["median"] / roof
            out.setdefault("roofline", {})[m] = dict(tok_s=roof, fraction=frac)
            print(f"{m}: batch-1 roofline {roof:.1f} tok/s, reached {frac:.0%}")
        phases = r["phases_batch1_ms"]
        if m.endswith("-eager"):
            print(f"{m}: batch-1 step by phase (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
        else:  # the timers run outside the graphs only: inside them every phase reads ~0
            print(f"{m}: batch-1 step {phases['step']:.2f} ms (phases are timed in the -eager modes only: "
                  "their timers stay out of the compiled graphs)")
    def ratio(num: str, den: str) -> None:
        if num in res and den in res:
            ratios = {b: res[num]["decode"][b]["median"] / res[den]["decode"][b]["median"] for b in args.batches}
            ratios["prefill"] = res[num]["prefill"]["median"] / res[den]["prefill"]["median"]
            out[f"{num}_over_{den}"] = ratios
            print(f"{num} / {den}: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))

    for num, den in (("a8w8", "bf16"), ("bf16", "bf16-eager"), ("a8w8", "a8w8-eager"), ("a8w8-eager", "bf16-eager")):
        ratio(num, den)
    if peer is not None:
        for m in res:
            ratios = {b: res[m]["decode"][b]["median"] / peer["decode"][b]["median"] for b in args.batches}
            ratios["prefill"] = res[m]["prefill"]["median"] / peer["prefill"]["median"]
            out.setdefault("over_vllm", {})[m] = ratios
            print(f"{m} / vllm: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    return out


STARTUP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from moeserve import LLM
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
graphs = llm.engine.runner.decode_graphs
print("STARTUP " + json.dumps(dict(seconds=time.perf_counter() - t0,
                                   compile_s=graphs.compile_seconds if graphs else 0.0)), flush=True)
"""


def startup_times(path: str, args) -> dict:
    """Seconds from `import moeserve` to a ready LLM, in fresh processes: the compiled modes with an empty
    compile cache (first start), then again with the cache it left (a later start); the eager mode once."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(args.threads))
        for label, mode in (("cold", "bf16"), ("cached", "bf16"), ("eager", "bf16-eager")):
            proc = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT, path, json.dumps(engine_kwargs(mode, args))],
                                  env=env, capture_output=True, text=True, timeout=1800)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("STARTUP ")), None)
            if line is None:
                print(f"start-up ({label}) failed:\n{proc.stderr[-4000:]}", flush=True)
                continue
            out[label] = json.loads(line[len("STARTUP "):])
            print(f"start-up {label}: {out[label]['seconds']:.1f} s (compiling {out[label]['compile_s']:.1f} s)",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                    help="moeserve with TP ranks (processes over gloo, --threads each): timed in wall time")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--startup", action="store_true",
                    help="also time engine start-up in fresh processes: cold (empty compile cache) and cached")
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--vllm-extra-path", default=None,
                    help="vLLM CPU: a folder put on its PYTHONPATH (docs/engine.md: zentorch for vLLM on AMD CPUs)")
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.2,
                    help="vLLM CPU: share of host memory it reserves (its --gpu-memory-utilization)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.peer or args.tensor_parallel_size > 1:  # engines in other processes: wall time then
        CLOCK = time.perf_counter
    path = v3_checkpoint()
    res = run_moeserve(path, args)
    peer = run_vllm(path, args) if args.peer == "vllm" else None
    out = report(res, peer, args)
    if args.startup:
        out["startup"] = startup_times(path, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
