"""Discrete-event simulation: a request stream through the REAL engine Scheduler, step times from the
cost model, so the planner and the server share one scheduling policy.

Lifecycle: requests arrive (Poisson or constant rate) -> Scheduler.add_request -> each step
Scheduler.schedule() picks work -> the cost model prices that exact batch -> the clock advances ->
Scheduler.update_from_output() with sampled tokens (1 + accepted MTP drafts) -> finished requests are
timed. One DP group is simulated; the instance's other DP groups run the same load (the rate is split).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from moeserve.config import SchedulerConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.engine.scheduler import Scheduler
from moeserve.planner.analysis import decode_memory
from moeserve.planner.deploy import Instance, Workload
from moeserve.planner.hardware import Hardware
from moeserve.planner.models import ModelSpec
from moeserve.planner.step import Batch, run_step
from moeserve.sampling_params import SamplingParams


@dataclass
class Trace:
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)


def arrivals(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate
        out.append(t)
    return out


def lengths(n: int, mean: int, kind: str, rng: random.Random) -> list[int]:
    if kind == "fixed":
        return [mean] * n
    if kind == "uniform":
        return [rng.randint(max(1, mean // 2), max(1, 3 * mean // 2)) for _ in range(n)]
    return [max(1, int(rng.expovariate(1.0 / mean))) for _ in range(n)]


def price(m: ModelSpec, hw: Hardware, inst: Instance, out, prefill_free: bool = False) -> float:
    """Seconds for the batch the scheduler picked: decodes (already-generated requests) vs prefill chunks.

    prefill_free: a PD decode instance receives prompts' KV from prefill instances, so their chunks cost
    no compute here (the transfer overlaps earlier steps)."""
    dec_ctx, dec_new, prefill = [], [], []
    for s in out.scheduled:
        if s.start >= s.request.num_prompt_tokens:
            dec_ctx.append(s.start)
            dec_new.append(s.num_tokens)
        elif not prefill_free:
            prefill.append((1.0, float(s.num_tokens), float(s.start)))
    n_dec = len(dec_ctx)
    if not n_dec and not prefill:
        return hw.eff.step_overhead_ms * 1e-3
    # A decode verifies 1 + drafts positions whatever the scheduler counted (drafts are the model's).
    new = 1 + inst.mtp_drafts if n_dec else 1.0
    b = Batch(n_dec, new, sum(dec_ctx) / n_dec if n_dec else 0.0, tuple(prefill))
    return run_step(m, hw, inst, b).total


def accepted(inst: Instance, rng: random.Random) -> int:
    """Drafts accepted this step: a chain, each with probability mtp_acceptance."""
    n = 0
    while n < inst.mtp_drafts and rng.random() < inst.mtp_acceptance:
        n += 1
    return n


def make_scheduler(m, hw, inst, wl, max_num_seqs, max_batched, max_len) -> Scheduler:
    rep = decode_memory(m, hw, inst, wl)
    per_token = m.kv_bytes_per_token(inst.kv_bytes, with_mtp=inst.mtp_drafts > 0)
    block = 16
    num_blocks = max(1, int(rep.kv_free // (per_token * block)))
    cfg = SchedulerConfig(max_num_seqs=max(1, rep.max_batch) if max_num_seqs is None else max_num_seqs,
                          max_num_batched_tokens=max_batched, max_model_len=max_len)
    return Scheduler(cfg, KVCacheManager(num_blocks, block))


def run(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, rate: float, num_requests: int,
        arrival: str = "poisson", length_dist: str = "fixed", max_num_seqs: int | None = None,
        max_batched: int = 8192, seed: int = 0, max_steps: int = 2_000_000,
        role: str = "unified") -> dict:
    """Simulate `num_requests` at `rate` requests/s into the whole instance; returns raw traces.

    role 'unified': prefill and decode share the instance (chunked prefill); 'decode': a PD decode
    instance whose prompts arrive prefilled."""
    if num_requests < 1 or not rate > 0:  # no stream to measure; a non-positive rate has no arrivals
        raise ValueError(f"simulate needs num_requests >= 1 and rate > 0, got {num_requests} and {rate}")
    rng = random.Random(seed)
    arr = arrivals(num_requests, rate / inst.dp, arrival, rng)
    ins = lengths(num_requests, wl.input_len, length_dist, rng)
    outs = lengths(num_requests, wl.output_len, length_dist, rng)
    if m.max_position_embeddings:  # tail draws stay inside the model's context window, as a server's would
        cap = m.max_position_embeddings
        ins = [min(i, cap - 1) for i in ins]
        outs = [max(1, min(o, cap - i)) for i, o in zip(ins, outs)]
    max_len = max(i + o for i, o in zip(ins, outs)) + 1 + inst.mtp_drafts
    sched = make_scheduler(m, hw, inst, wl, max_num_seqs, max_batched, max_len)
    traces = {str(i): Trace(a, p, o) for i, (a, p, o) in enumerate(zip(arr, ins, outs))}
    clock, nxt, steps, busy = 0.0, 0, 0, 0.0
    while steps < max_steps and (nxt < num_requests or sched.has_unfinished()):
        while nxt < num_requests and arr[nxt] <= clock:
            t = traces[str(nxt)]
            sched.add_request(Request(str(nxt), [1] * t.prompt_len,
                                      SamplingParams(max_tokens=t.output_len, ignore_eos=True),
                                      arrival_time=t.arrival))
            nxt += 1
        out = sched.schedule()
        if out.is_empty:
            if nxt >= num_requests:
                break  # nothing runnable and nothing left to arrive
            clock = max(clock, arr[nxt])
            continue
        dt = price(m, hw, inst, out, prefill_free=role == "decode")
        clock += dt
        busy += dt
        steps += 1
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                n = 1 + accepted(inst, rng) if s.start >= s.request.num_prompt_tokens else 1
                sampled[s.request.request_id] = [0] * n
                traces[s.request.request_id].token_times += [clock] * n
        sched.update_from_output(out, sampled)
    return {"traces": traces, "makespan": clock, "steps": steps, "busy": busy,
            "preemptions": sched.num_preemptions}


def default_rate(m, hw, inst, wl, role: str) -> float:
    """80% of capacity (requests/s): decode at its memory-limited batch, plus prefill when unified."""
    from moeserve.planner.analysis import decode_point
    from moeserve.planner.step import prefill_step
    cap = decode_memory(m, hw, inst, wl).max_batch
    pt = decode_point(m, hw, inst, wl, max(1, cap))
    per_req = wl.output_len / (pt.tok_s_card * inst.cards)  # card-seconds... per request, instance-wide
    if role == "unified":
        per_req += prefill_step(m, hw, inst, 1, wl.input_len).total / inst.dp
    return 0.8 / per_req


def simulate_from_args(a, m, hw, inst, wl) -> dict:
    from moeserve.planner.sim_report import analytic_steady_state, summarize
    rate = default_rate(m, hw, inst, wl, a.role) if a.rate is None else a.rate
    raw = run(m, hw, inst, wl, rate, a.num_requests, a.arrival, a.length_dist, a.max_num_seqs,
              a.max_num_batched_tokens, a.seed, role=a.role)
    res = summarize(raw, inst, a.tpot_ms, a.ttft_ms, window=(0.2, 0.9))
    res.update({"model": m.name, "hardware": hw.key, "rate_req_s": round(rate, 4),
                "arrival": a.arrival, "role": a.role, "length_dist": a.length_dist,
                "analytic_steady_state": analytic_steady_state(m, hw, inst, wl, rate)})
    return res


def format_report(r: dict) -> str:
    def row(name):
        d = r[name]
        return f"  {name:<8} p50 {d['p50']:9.2f}  p90 {d['p90']:9.2f}  p99 {d['p99']:9.2f}  (ms)"
    a = r["analytic_steady_state"]
    return "\n".join([
        f"{r['model']} on {r['hardware']}: {r['rate_req_s']:.3f} req/s ({r['arrival']}, lengths "
        f"{r['length_dist']}), {r['requests_measured']} requests measured, {r['steps']} steps, "
        f"{r['preemptions']} preemptions",
        row("ttft_ms"), row("tpot_ms"), row("itl_ms"),
        f"  throughput {r['throughput_tok_s_card']:.1f} tok/s/card, goodput {r['goodput_tok_s_card']:.1f}",
        f"  analytic steady state: batch {a['batch_per_dp']}/DP, TPOT {a['tpot_ms']} ms"])
