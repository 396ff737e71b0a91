"""Percentiles, goodput and the analytic steady state for `moeserve plan simulate`."""
from __future__ import annotations

from moeserve.planner.analysis import decode_memory, decode_point
from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile, p in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _pcts(xs: list[float]) -> dict:
    """ms; None when nothing was measured (JSON has no NaN)."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {f"p{p}": round(1e3 * percentile(xs, p), 3) for p in (50, 90, 99)} | {
        "mean": round(1e3 * sum(xs) / len(xs), 3)}


def summarize(raw: dict, inst: Instance, tpot_slo_ms: float | None, ttft_slo_ms: float | None,
              window: tuple[float, float] = (0.0, 1.0), cards_per_group: float | None = None) -> dict:
    """Latency percentiles over requests whose arrival rank lies in `window` (drop warm-up/drain).

    Per-card figures divide the simulated groups' tokens by `cards_per_group` x the groups simulated:
    a group's TP cards (default), or in a PD deployment all cards over the decode DP groups."""
    ttft, tpot, itl, good, measured, tokens, done, met = [], [], [], 0, 0, 0, 0, 0
    traces = list(raw["traces"].values())
    lo, hi = int(window[0] * len(traces)), int(window[1] * len(traces))
    hi = max(hi, min(lo + 1, len(traces)))  # a tiny stream still measures a request
    for i, t in enumerate(traces):
        if len(t.token_times) < t.output_len:
            continue  # unfinished within the step cap
        tokens += len(t.token_times)
        if not lo <= i < hi:
            continue
        done += 1
        first = t.token_times[0] - t.arrival
        ttft.append(first)
        per_tok = (t.token_times[-1] - t.token_times[0]) / max(1, len(t.token_times) - 1)
        if len(t.token_times) > 1:  # one token has no time per output token (as vLLM's benchmark counts)
            tpot.append(per_tok)
        itl += [b - a for a, b in zip(t.token_times, t.token_times[1:]) if b > a]
        ok = (ttft_slo_ms is None or first * 1e3 <= ttft_slo_ms) and (
            tpot_slo_ms is None or per_tok * 1e3 <= tpot_slo_ms)
        met += ok
        good += ok * len(t.token_times)
        measured += len(t.token_times)
    # The run: first arrival to last token, as `moeserve bench serve` times it (its first request goes out
    # at once; the simulated clock starts one arrival gap before the first request).
    span = max(raw["makespan"] - min((t.arrival for t in traces), default=0.0), 0.0) or 1.0
    # Steady throughput: tokens out while the measured window's requests arrive (no ramp-up, no drain).
    t0, t1 = traces[lo].arrival if traces else 0.0, traces[max(lo, hi - 1)].arrival if traces else 0.0
    steady = sum(t0 <= x <= t1 for t in traces for x in t.token_times) / (t1 - t0) if t1 > t0 else None
    # Per card = the simulated groups' tokens / (time x the cards they stand for).
    cards = (inst.tp if cards_per_group is None else cards_per_group) * raw.get("groups", 1)
    return {"requests_measured": done, "steps": raw["steps"], "preemptions": raw["preemptions"],
            "makespan_s": round(span, 3), "busy_fraction": round(raw["busy"] / span, 4),
            "ttft_ms": _pcts(ttft), "tpot_ms": _pcts(tpot), "itl_ms": _pcts(itl),
            "throughput_tok_s_card": round(tokens / span / cards, 2),
            "steady_tok_s_card": None if steady is None else round(steady / cards, 2),  # None: a burst
            # the run's throughput x the share of the measured requests' tokens inside the SLOs (the
            # measured tokens scaled up to the stream overshot the throughput when lengths vary)
            "goodput_tok_s_card": round(tokens * good / (measured or 1) / span / cards, 2),
            "slo_met_fraction": round(met / done, 4) if done else None}


def decode_capacity(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload) -> float:
    """Requests/s one instance finishes at its memory-limited batch."""
    cap = max(1, decode_memory(m, hw, inst, wl).max_batch)
    return decode_point(m, hw, inst, wl, cap).tok_s_card * inst.cards / wl.output_len


def analytic_steady_state(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload,
                          rate: float) -> dict:
    """Fixed point of B = rate_per_dp x time-in-decode(B): batch, TPOT, for a constant-rate stream.

    Ignores prefill interference, so it is exact when prompts are short next to the decode work. A rate
    whose fixed point lies beyond the memory-limited batch has none (the queue grows without bound):
    `overloaded`, with the rate the memory-limited batch sustains.
    """
    lam = rate / inst.dp
    cap = max(1, decode_memory(m, hw, inst, wl).max_batch)
    b = 1.0
    for _ in range(200):
        pt = decode_point(m, hw, inst, wl, max(1, round(b)))
        step_s = pt.step_ms / 1e3
        b_new = lam * wl.output_len / inst.tokens_per_step * step_s
        if b_new > cap:
            return {"overloaded": True, "max_batch_per_dp": cap, "batch_per_dp": None, "step_ms": None,
                    "tpot_ms": None, "capacity_req_s": round(decode_capacity(m, hw, inst, wl), 4)}
        if abs(b_new - b) < 1e-3:
            break
        b = 0.5 * (b + b_new)
    # Interpolate the step time at fractional b between the integer batches around it.
    lo, hi = max(1, int(b)), max(1, int(b)) + 1
    s_lo = decode_point(m, hw, inst, wl, lo).step_ms
    s_hi = decode_point(m, hw, inst, wl, hi).step_ms
    step_ms = s_lo + (s_hi - s_lo) * (b - lo) if b >= 1 else s_lo
    return {"overloaded": False, "max_batch_per_dp": cap, "batch_per_dp": round(b, 3),
            "step_ms": round(step_ms, 3), "tpot_ms": round(step_ms / inst.tokens_per_step, 3)}
