"""CPU check: predict moeserve's own CPU decode step times from a measured CPU profile.

Profile: planner/cpuprofile.py (this machine's rates and per-call costs, measured with torch). The
prediction is the planner's own cost model on a one-card "device" built from those numbers (efficiency
1.0: the profile already measures achieved rates; HBM bandwidth = the GEMM weight-streaming bandwidth,
since decode reads its bytes through GEMMs; with the step's GEMM calls counted by kernel class, each GEMM
op's bytes re-priced at its class's rate: the routed experts' at the fused MoE's, kv_b's share of the
attention projections at the bmm's, the rest at the Linear's; a class the step does not run or the profile
did not measure takes the Linear's) plus, per class of what one decode step runs, calls x the measured cost
of one call (GEMM calls at their kernel class's fixed cost). The compiled step (the engine's default) is counted from a profile of one real
step (planner/cpucount.py: graph runs, fused kernels and the graphs' C++ helpers, calls of our opaque ops,
GEMMs, views, other ops),
dynamo's cache lookups the step counts (none once the engine's DirectGraphs call its graphs directly) priced
at one lookup timed on the engine's own layers, and the other per-call costs come from microbenchmarks here
(a trivial graph's run past its lookup, called through DirectGraphs as the engine calls its layers, and its
kernel; a mix of the graphs' helpers; a trivial custom op; a mix of views); the eager step (--eager)
is counted by a dispatch mode (GEMM calls, every other op at the small-op cost). The compiled step's counts
cover the model forward; two more terms come from the host model (issue 41: the bench model's structure at
widths of a few dozen, its engine measured as the bench model's is, caches emptied by a 32 MB read before each
step, as the bench model's weights empty them): the work a step does outside the forward
(scheduler, inputs, LM head and sampler, outputs), once a step, and what its forward takes beyond its counted
calls at the profile's prices (the graphs' generated Python, our ops' bodies), per graph run (measure_host_rows).
The counts are structural, not timings: nothing is fitted to the measured step.
Measured side: engine step times of decode-only steps on the bench model (moeserve/bench_model.py). The
profile takes the best of several runs, so the error is reported against the fastest measured step
(uncontended, like the profile); the median is shown too (shared machines are noisy). The GEMM kernels'
streaming pools are swept once before each timed step, and a batch is priced at the best of its own sweeps
(run_check), so both sides see the same minutes of a shared machine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from moeserve.perf import cost
from moeserve.perf.deploy import Instance
from moeserve.planner import cpucount, cpuprofile
from moeserve.planner.cpuprofile import profile, timed
from moeserve.perf.hardware import cpu_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step



# Per-call price of each counted class (cpucount.CLASSES): the profile's measured cost of one such call; a
# lookup's is measured per engine on its own layers (cpucount.lookup_seconds), passed to predict.
PRICES = {"graph": "graph_entry_us", "kernel": "kernel_us", "helper": "graph_helper_us", "opaque": "opaque_call_us",
          "gemm": "gemm_call_us", "attention": "mla_call_us", "view": "view_us", "op": "op_cost_us"}


# Each GEMM kernel class (cpucount.KERNELS): the profile's (streaming GB/s, fixed us per call) keys for it. The
# Linear's are always measured; the fused MoE's only where a fused kernel runs here, the absorbed products' always
# (bmm_cpu, or aten's bmm where the library is absent).
KERNEL_PRICES = {"linear": ("gemm_stream_gbs", "gemm_call_us"), "moe": ("moe_stream_gbs", "moe_call_us"),
                 "bmm": ("bmm_stream_gbs", "bmm_call_us")}


def kernel_rates(prof: dict, kernels: dict | None) -> dict:
    """(GB/s, us per call) per GEMM kernel class: a class the step runs (`kernels`: its GEMM calls per class, from
    the counted profile) at its own measured rate where the profile has one; everything else, and every class
    when the step's kernels were not counted, at the Linear's."""
    linear = tuple(prof[k] for k in KERNEL_PRICES["linear"])
    rates = {}
    for kernel, keys in KERNEL_PRICES.items():
        own = (kernels or {}).get(kernel) and all(prof.get(k) is not None for k in keys) and prof[keys[0]] > 0
        rates[kernel] = tuple(prof[k] for k in keys) if own else linear
    return rates


def gemm_byte_shares(m, op_name: str) -> dict:
    """The share of a cost-model op's bytes each GEMM kernel class reads in the engine (decode_step's op names):
    the routed experts through the fused MoE, MLA's absorbed products (kv_b's W_UK / W_UV, a part of attn_proj's
    weights) through the batched GEMM, the other projections, the dense MLP, the router, shared experts and LM
    head through the Linear's; {} for an op that is not a GEMM (MLA decode, elementwise passes)."""
    if op_name == "routed_experts":
        return {"moe": 1.0}
    if op_name == "attn_proj":
        absorbed = m.kv_lora_rank * m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        share = absorbed / (m.q_a_params + m.kv_a_params + m.attn_split_params)
        return {"linear": 1.0 - share, "bmm": share}
    if op_name in ("router", "shared_experts", "dense_mlp", "lm_head", "eh_proj"):
        return {"linear": 1.0}
    return {}


def predict(prof: dict, batch: int, context: float, counts: dict | None = None, lookup_us: float = 0.0,
            kernels: dict | None = None, host_us: float = 0.0, graph_python_us: float = 0.0) -> dict:
    """Step time = the planner's cost model on this CPU (bytes / streaming bandwidth, FLOPs / rate) + each
    counted class x its measured per-call cost (dynamo cache lookups, compiled step: `lookup_us` each). With
    `kernels` (the step's GEMM calls per kernel class, cpucount.gemm_kernels) each GEMM's weight bytes stream at
    its kernel class's measured rate and each call pays that class's fixed cost (kernel_rates): a GEMM op's
    time is max(FLOPs / rate, sum over classes of its bytes in the class / the class's bandwidth). With counts,
    `host_us` is added once a step (the step's work outside the model forward, whose ops the counts leave out)
    and `graph_python_us` per graph run (the forward's Python beyond its counted calls), both measured on the
    host model (measure_host_rows): by_class_ms "host" and "graph_python"."""
    m = load_model("moeserve-bench")
    rates = kernel_rates(prof, kernels)
    price = {c: lookup_us if c == "lookup" else prof[PRICES[c]] for c in (counts or {})}
    by_class = {c: n * price[c] * 1e-3 for c, n in (counts or {}).items()}
    if kernels and "gemm" in by_class:
        by_class["gemm"] = sum(n * rates[k][1] for k, n in kernels.items()) * 1e-3
    if counts and host_us:
        by_class["host"] = host_us * 1e-3
    if counts and graph_python_us:
        by_class["graph_python"] = counts.get("graph", 0) * graph_python_us * 1e-3
    overhead_ms = sum(by_class.values())
    hw = cpu_hardware(prof, overhead_ms)
    if prof.get("mla_decode_gflops"):  # decode MLA at the attention kernel's measured rate (the cost model's
        # mla_tflops, as for a device whose MLA kernel is measured), not at the GEMM rate
        hw = dataclasses.replace(hw, eff=dataclasses.replace(hw.eff, mla_tflops=prof["mla_decode_gflops"] / 1e3))
    st = decode_step(m, hw, Instance(cards=1, quantization="bf16"), batch, context)
    # The cost model prices every GEMM's bytes at the Linear's rate (the device's bandwidth); each GEMM op again
    # with its bytes split by kernel class, each share at its class's rate
    peak = hw.peak_flops("bf16") * hw.eff.gemm * hw.eff.serving
    mem_eff = cost.gemm_mem_eff(hw) * hw.eff.serving
    delta, gemm_mb = 0.0, dict.fromkeys(KERNEL_PRICES, 0.0)
    for op in st.ops:
        shares = gemm_byte_shares(m, op.name)
        if not shares:
            continue
        t_mem = sum(f * op.nbytes / (rates[k][0] * 1e9 * mem_eff) for k, f in shares.items())
        delta += max(op.flops / peak, t_mem) - op.seconds
        for k, f in shares.items():
            gemm_mb[k] += f * op.nbytes / 1e6
    roofline = st.total - st.overhead + delta
    return {"step_ms": (roofline + st.overhead) * 1e3, "roofline_ms": roofline * 1e3,
            "overhead_ms": st.overhead * 1e3, "by_class_ms": by_class, "gemm_mb": gemm_mb,
            "kernel_rates": rates}


def count_ops(engine) -> tuple[dict, dict]:
    """Aten ops in one engine step by class (runs the step): GEMM calls, attention kernel calls, every other
    op (views included: in the eager step each is a dispatched op at the small-op cost); and the GEMM calls
    by kernel class (cpucount.gemm_kernel_class)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"gemm": 0, "attention": 0, "op": 0}
    kernels = dict.fromkeys(cpucount.KERNELS, 0)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts["gemm" if name in cpucount.GEMM_OPS else "attention" if name in cpucount.ATTENTION_OPS
                   else "op"] += 1
            if name in cpucount.GEMM_OPS:
                kernels[cpucount.gemm_kernel_class(name)] += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        engine.step()
    return counts, kernels


@contextlib.contextmanager
def _timing(into: list):
    """Appends the seconds its body took to `into`."""
    t = time.perf_counter()
    yield
    into.append(time.perf_counter() - t)


def measure_engine(batches: list[int], prompt_len: int = 128, steps: int = 16,
                   checkpoint: str | None = None, eager: bool = False, flush_mb: int = 0,
                   probe=None) -> list[dict]:
    """Decode-step times of the CPU engine per batch size on checkpoint (default: the bench model), with what
    one step runs counted by class: compiled (the engine's default; cpucount.count_compiled_step, and the
    price of one dynamo cache lookup timed on its own layers: cpucount.lookup_seconds, reported as lookup_us
    whether or not the step counted any) or eager (`eager`: count_ops's dispatch mode, every op at the
    small-op cost, GEMMs and attention kernels at their call costs; it cannot run inside compiled graphs).
    Each timed step's model forward (the runner's) is timed too: forward_ms (the best) and host_ms (the best
    step less its forward: the step's work outside the model). With `flush_mb`, a buffer that large is
    read before each timed step (untimed), so the step starts on cold caches (measure_host_rows). With `probe`
    (cpuprofile.StreamingProbe), its pools are swept once, untimed, before each timed step (recorded under the
    batch) and once before them (a warm-up, not recorded)."""
    from moeserve.llm import LLM
    from moeserve.sampling_params import SamplingParams
    from moeserve.bench_model import bench_checkpoint
    from moeserve.protocol import EngineCoreRequest

    llm = LLM(checkpoint or bench_checkpoint(), dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * prompt_len, enable_prefix_caching=False, enforce_eager=eager)
    eng, rows = llm.engine, []
    if not eager and eng.runner.decode_graphs is None:
        raise RuntimeError("the engine runs its decode eagerly (MOESERVE_ENFORCE_EAGER=1 in the environment?); "
                           "measure with eager=True (--eager) or without that setting")
    for b in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(b):
            ids = [(7 * i + j) % 31000 + 2 for j in range(prompt_len)]
            eng.add_request(EngineCoreRequest(f"b{b}-{i}", ids, params, []))
        eng.step()  # prefill
        lookup_us, profiled, kernel_ms = 0.0, None, None
        if eager:
            counts, kernels = count_ops(eng)
        else:
            eng.step()  # the first decode step through the graphs: lazy state settles outside the count
            counts, profiled, kernels, kernel_ms = cpucount.count_compiled_step(eng)
            counts, profiled = dict(counts), {c: round(v, 3) for c, v in profiled.items()}
            kernels, kernel_ms = dict(kernels), {k: round(v, 3) for k, v in kernel_ms.items()}
            lookup_us = 1e6 * cpucount.lookup_seconds(eng, b)
        times, forwards = [], []
        # read, not written: the bench model's weights pass through the caches clean (a written buffer would
        # leave dirty lines whose write-backs land in the timed work)
        flush = torch.ones(flush_mb << 18) if flush_mb else None  # float32: flush_mb MB
        if probe is not None:
            probe.sweep(None)
        with cpucount.wrapping_forward(eng.runner, lambda: _timing(forwards)):
            for _ in range(steps):
                if flush is not None:
                    flush.sum()
                if probe is not None:
                    probe.sweep(b)
                times.append(timed(eng.step))
        host = min(t - f for t, f in zip(times, forwards))
        while eng.has_unfinished():
            eng.step()
        times.sort()
        rows.append({"batch": b, "context": prompt_len + 3 + steps / 2, "counts": counts, "lookup_us": lookup_us,
                     "profiled_ms": profiled, "gemm_kernels": kernels, "profiled_gemm_kernel_ms": kernel_ms,
                     "ops_per_step": sum(counts.values()), "gemms_per_step": counts["gemm"],
                     "measured_ms": 1e3 * times[0], "measured_median_ms": round(1e3 * times[len(times) // 2], 3),
                     "forward_ms": round(1e3 * min(forwards), 3), "host_ms": round(1e3 * host, 3)})
    return rows


# The host model (measure_host_rows): the bench config (moeserve/bench_model.py) with every width cut to a few dozen,
# the same structure (layers, experts, top-k, groups, heads, vocabulary): the engine runs the same graphs, ops and
# Python per step over weights too small to take time
HOST_CONFIG = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=32,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
# Read before each of the host model's timed steps (as large as an AMD Zen 4 CCD's L3; the bench model's step
# reads ~20-30 MB of weights a layer and its 65 MB LM head right before the sampler): the bench model's step
# starts, and its work after the forward runs, on caches its weights emptied. (Also read before each graph run,
# 2026-12-07: +9 to +40% at batch 1, the forward's residual noisy, 455-1240 us a run; left out.)
HOST_FLUSH_MB = 32


def host_checkpoint() -> str:
    """The host model's checkpoint (HOST_CONFIG), written once with the bench model's helper."""
    from moeserve.bench_model import BENCH_CONFIG, bench_checkpoint

    return bench_checkpoint(config={**BENCH_CONFIG, **HOST_CONFIG})


def host_prices(prof: dict, rows: list[dict]) -> dict:
    """{batch: {"host_us", "graph_python_us"}} from the host model's measured rows (measure_engine on
    host_checkpoint, caches flushed before each step): host_us, the work a step does outside the model forward
    (scheduler, inputs, the LM head and sampler, outputs: its best step less its forward), less the host model's
    LM head weights at the Linear's streaming rate (the bench model's head is in the roofline); graph_python_us,
    what its forward took beyond its own counted calls at the profile's prices (the graphs' generated Python and
    wrappers, our ops' bodies beyond a trivial op's call: nothing of it is a counted call), per graph run, less
    its decode attention's FLOPs at the profile's MLA rate where it has one (as the cost model prices the bench
    model's: 2 x rows x heads x (2 C + rope dims) x context a layer). Its weights are ~0.1-0.2 MB a layer read:
    not taken out."""
    from moeserve.bench_model import BENCH_CONFIG

    c = {**BENCH_CONFIG, **HOST_CONFIG}
    head_s = 2.0 * c["vocab_size"] * c["hidden_size"] / (prof["gemm_stream_gbs"] * 1e9)
    out = {}
    for r in rows:
        priced = predict(prof, r["batch"], r["context"], r["counts"], r["lookup_us"], r["gemm_kernels"])
        mla_flops = (2.0 * r["batch"] * c["num_attention_heads"] * (2 * c["kv_lora_rank"] + c["qk_rope_head_dim"])
                     * r["context"] * c["num_hidden_layers"])
        mla_ms = mla_flops / (prof["mla_decode_gflops"] * 1e6) if prof.get("mla_decode_gflops") else 0.0
        rest_ms = r["forward_ms"] - sum(priced["by_class_ms"].values()) - mla_ms
        out[r["batch"]] = {"host_us": max(0.0, r["host_ms"] * 1e3 - head_s * 1e6),
                           "graph_python_us": max(0.0, rest_ms) * 1e3 / max(1, r["counts"]["graph"])}
    return out


def measure_host_rows(batches: list[int]) -> list[dict]:
    """The host model's engine (HOST_CONFIG) at these batch sizes, measured as the bench model's engine is
    (measure_engine), each timed step on cold caches (HOST_FLUSH_MB); host_prices turns its rows into the two
    terms. [] (the terms left out, the prediction as before them) with a warning where the host model's engine
    fails here (a kernel library that refuses its small widths)."""
    import gc
    import warnings

    try:
        return measure_engine(batches, checkpoint=host_checkpoint(), flush_mb=HOST_FLUSH_MB)
    except Exception as e:  # noqa: BLE001 - any failure of the host model leaves its two terms out
        warnings.warn(f"CPU check: the host model's engine failed ({type(e).__name__}: {e}); the step's host "
                      "work outside the GEMMs is not priced")
        return []
    finally:
        gc.collect()  # the host model's engine goes before the bench model's runs


def run_check(batches: list[int], measure: bool = False, threads: int | None = None, eager: bool = False) -> dict:
    """The profile, and with `measure` the engine's measured steps against the prediction. Measuring, the GEMM
    kernels' streaming pools are swept again once before each timed step (cpuprofile.StreamingProbe) and each
    batch is priced at the rates of its own sweeps (the profile's, best of 5 before the engine, stay in
    "profile", and the prediction at them per row in "predicted_profile_rates_ms": diagnostics)."""
    if threads is not None:
        torch.set_num_threads(threads)
    host_rows = measure_host_rows(batches) if measure and not eager else []
    probe = cpuprofile.StreamingProbe()  # after the host model: freeing its engine flushes zentorch's cache
    try:
        prof = profile(threads, probe)
        load = _load_average()
        rows = measure_engine(batches, eager=eager, probe=probe) if measure else [
            {"batch": b, "context": 138.0, "counts": None, "lookup_us": 0.0, "ops_per_step": None,
             "gemms_per_step": None, "gemm_kernels": None, "measured_ms": None} for b in batches]
        own = {r["batch"]: {**prof, **probe.rates(r["batch"])} for r in rows if measure}
        instances = {r["batch"]: {k: [round(bw / 1e9, 1) for bw, _ in f] for k, f in probe.fits(r["batch"]).items()}
                     for r in rows if measure}  # each pool instance's rate, a diagnostic
    finally:
        probe.close()
    for r in rows:
        at = own.get(r["batch"], prof)
        host = {row["batch"]: row for row in host_rows}.get(r["batch"])
        r.update(host_prices(at, [host])[r["batch"]] if host else {})
        p = predict(at, r["batch"], r["context"], r["counts"], r["lookup_us"], r["gemm_kernels"],
                    r.get("host_us", 0.0), r.get("graph_python_us", 0.0))
        r.update({"predicted_ms": round(p["step_ms"], 3), "predicted_roofline_ms": round(p["roofline_ms"], 3),
                  "predicted_overhead_ms": round(p["overhead_ms"], 3),
                  "by_class_ms": {c: round(v, 3) for c, v in p["by_class_ms"].items()},
                  "gemm_mb": {k: round(v, 2) for k, v in p["gemm_mb"].items()},
                  "kernel_rates": {k: [round(v, 3) for v in r_] for k, r_ in p["kernel_rates"].items()}})
        if at is not prof:  # the prediction at the profile's own rates, as before the sweeps (a diagnostic)
            before = host_prices(prof, [host])[r["batch"]] if host else {}
            r["predicted_profile_rates_ms"] = round(predict(
                prof, r["batch"], r["context"], r["counts"], r["lookup_us"], r["gemm_kernels"],
                before.get("host_us", 0.0), before.get("graph_python_us", 0.0))["step_ms"], 3)
            r["stream_sweeps"] = at["stream_sweeps"]
            r["stream_instances_gbs"] = instances[r["batch"]]
        if r["measured_ms"]:
            r["measured_ms"] = round(r["measured_ms"], 3)
            r["error_pct"] = round(100 * (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"], 1)
    return {"profile": {k: round(v, 3) for k, v in prof.items()}, "rows": rows, "measured": measure,
            "step": "eager" if eager else "compiled", "load_before": load, "load_after": _load_average()}


def _load_average() -> float | None:
    """The 1-minute load average (the machine's other work while measuring), where the OS reports one."""
    try:
        import os
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def format_report(res: dict) -> str:
    p = res["profile"]
    lines = [f"CPU profile: {p['mem_bw_gbs']:.1f} GB/s read, weights through GEMMs {p['gemm_stream_gbs']:.1f} GB/s "
             f"+ {p['gemm_call_us']:.1f} us per call, {p['gemm_bf16_gflops']:.0f} GFLOP/s BF16 GEMM "
             f"({p['gemm_decode_gflops']:.0f} at 64x1024x1024), {p['op_cost_us']:.1f} us per small op, "
             f"{p['view_us']:.1f} per view, graph run {p['graph_entry_us']:.1f} us + {p['kernel_us']:.1f} per "
             f"fused kernel + {p['graph_helper_us']:.2f} per helper call, custom op call {p['opaque_call_us']:.1f} us, "
             f"decode MLA {p.get('mla_decode_gflops', 0):.0f} GFLOP/s + {p.get('mla_call_us', 0):.1f} us per call, "
             f"{p['threads']:.0f} threads",
             f"GEMM kernels (profile, best of {p.get('stream_sweeps', 0):.0f} sweeps): Linear op "
             + f"{p['gemm_stream_gbs']:.1f} GB/s + {p['gemm_call_us']:.1f} us, fused MoE "
             + (f"{p['moe_stream_gbs']:.1f} GB/s + {p['moe_call_us']:.1f} us" if "moe_stream_gbs" in p else "none here")
             + ", absorbed bmm " + (f"{p['bmm_stream_gbs']:.1f} GB/s + {p['bmm_call_us']:.1f} us"
                                    if "bmm_stream_gbs" in p else "not measured"),
             f"{res['step']} decode step; load average {res['load_before']} before, {res['load_after']} after",
             f"{'batch':>5} {'ops':>6} {'roofline ms':>12} {'overhead ms':>12} {'predicted ms':>13} "
             f"{'best ms':>9} {'median ms':>10} {'error':>7}"]
    for r in res["rows"]:
        meas = (f"{r['measured_ms']:>9.2f} {r['measured_median_ms']:>10.2f}" if r["measured_ms"]
                else f"{'-':>9} {'-':>10}")
        err = f"{r['error_pct']:>+6.1f}%" if "error_pct" in r else f"{'-':>7}"
        lines.append(f"{r['batch']:>5} {r['ops_per_step'] or '-':>6} {r['predicted_roofline_ms']:>12.2f} "
                     f"{r['predicted_overhead_ms']:>12.2f} {r['predicted_ms']:>13.2f} {meas} {err}")
    for r in res["rows"]:
        if r["counts"]:
            price = {**{c: p.get(k, 0.0) for c, k in PRICES.items()}, "lookup": r["lookup_us"]}
            parts = [f"{c} {r['counts'][c]} x {price[c]:.1f} us = {r['by_class_ms'][c]:.2f}"
                     if not (c == "gemm" and r.get("gemm_kernels")) else
                     f"gemm {r['counts'][c]} (by kernel: " + " + ".join(
                         f"{r['gemm_kernels'][k]} x {r['kernel_rates'][k][1]:.1f} us" for k in cpucount.KERNELS)
                     + f") = {r['by_class_ms'][c]:.2f}"
                     for c in cpucount.CLASSES if c in r["counts"]]
            if "host" in r["by_class_ms"]:
                parts.append(f"host (outside the forward) 1 x {r['host_us']:.0f} us = {r['by_class_ms']['host']:.2f}")
            if "graph_python" in r["by_class_ms"]:
                parts.append(f"graph python {r['counts']['graph']} x {r['graph_python_us']:.1f} us = "
                             f"{r['by_class_ms']['graph_python']:.2f}")
            lines.append(f"  batch {r['batch']} overhead ms: " + ", ".join(parts))
        if r.get("gemm_kernels"):
            rates = r["kernel_rates"]
            lines.append(f"  batch {r['batch']} GEMMs by kernel: " + ", ".join(
                f"{k} {r['gemm_kernels'].get(k, 0)} calls {r['gemm_mb'].get(k, 0):.1f} MB at {rates[k][0]:.1f} GB/s"
                + (f" (profiled {r['profiled_gemm_kernel_ms'][k]:.2f} ms)" if r.get("profiled_gemm_kernel_ms") else "")
                for k in cpucount.KERNELS))
        if "predicted_profile_rates_ms" in r:
            before = r["predicted_profile_rates_ms"]
            err = f" ({100 * (before - r['measured_ms']) / r['measured_ms']:+.1f}%)" if r["measured_ms"] else ""
            lines.append(f"  batch {r['batch']} GEMM rates above from the {r['stream_sweeps']:.0f} sweeps between its "
                         f"timed steps (pool instances, GB/s: " + ", ".join(
                             f"{k} {'/'.join(map(str, v))}" for k, v in r.get("stream_instances_gbs", {}).items())
                         + f"); at the profile's rates: predicted {before:.2f} ms{err}")
        if r.get("forward_ms") is not None:
            lines.append(f"  batch {r['batch']} measured step split (diagnostic): forward {r['forward_ms']:.2f} ms, "
                         f"outside it {r['host_ms']:.2f} ms (LM head, sampler, scheduler, outputs)")
        if r.get("profiled_ms"):
            lines.append(f"  batch {r['batch']} profiled step ms (diagnostic, +~1 us per event): "
                         + ", ".join(f"{c} {v:.2f}" for c, v in r["profiled_ms"].items()))
    if not res["measured"]:
        lines.append("(run with --measure to time the engine and report the error)")
    return "\n".join(lines)
