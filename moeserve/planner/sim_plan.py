"""What `moeserve plan simulate` and `plan search --simulate` run on top of the simulator (simulate.py):
default rates and request counts, refusals labelled by instance, the result dict and its text report."""
from __future__ import annotations

from contextlib import contextmanager

from moeserve.perf.deploy import DoesNotFit, Instance, Workload
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec
from moeserve.planner.analysis import layout
from moeserve.planner.sim_report import analytic_steady_state, decode_capacity, summarize
from moeserve.planner.simulate import PROXIES, run, run_pd


def default_rate(m, hw, inst, wl, role: str) -> float:
    """80% of capacity (requests/s): decode at its memory-limited batch, plus prefill when unified."""
    from moeserve.perf.step import prefill_step
    per_req = 1.0 / decode_capacity(m, hw, inst, wl)
    if role == "unified":
        c = wl.cached_prompt_tokens
        per_req += prefill_step(m, hw, inst, 1, wl.input_len - c, past=c).total / inst.dp
    return 0.8 / per_req


def default_rate_pd(m, hw, pre, dec, wl, prefill_instances: int, decode_instances: int) -> float:
    """80% of the slower side: prefill instances each starting one prompt per DP group per forward, or
    decode instances at their memory-limited batch."""
    from moeserve.planner.analysis import prefill_point
    pt = prefill_point(m, hw, pre, pre.dp, wl.input_len, wl.cached_prompt_tokens)
    prefill = prefill_instances * pre.dp / (pt.ttft_ms * 1e-3)
    return 0.8 * min(prefill, decode_instances * decode_capacity(m, hw, dec, wl))


@contextmanager
def _labelled(label: str | None):
    """A PD refusal says which of the two instances it is about."""
    try:
        yield
    except DoesNotFit as e:
        raise DoesNotFit(f"{label}: {e}" if label else str(e)) from None


def simulate_from_args(a, m, hw, inst, wl, pre: Instance | None = None) -> dict:
    """`pre`: the prefill instance of a PD deployment (--role pd)."""
    from moeserve.planner.analysis import kv_pull_ms, prefill_point, require_fits
    with _labelled(f"decode instance ({inst.cards} cards)" if pre else None):
        require_fits(m, hw, inst, wl)  # a layout that does not fit is refused (exit 1), not simulated
    if a.role != "pd":
        rate = default_rate(m, hw, inst, wl, a.role) if a.rate is None else a.rate
        analytic = analytic_steady_state(m, hw, inst, wl, rate)
        n = a.num_requests or settling_requests(analytic)
        raw = run(m, hw, inst, wl, rate, n, a.arrival, a.length_dist, a.max_num_seqs,
                  a.max_num_batched_tokens, a.seed, role=a.role, groups=a.sim_dp_groups)
        res = summarize(raw, inst, a.tpot_ms, a.ttft_ms, window=(0.2, 0.9))
    else:
        p_n, d_n, proxy = a.prefill_instances, a.decode_instances, a.pd_proxy or PROXIES[0]
        # One prompt in every prefill DP group: the step the simulator prices (the groups run in lockstep);
        # refuses a prefill layout that does not fit.
        with _labelled(f"prefill instance ({pre.cards} cards)"):
            prefill_point(m, hw, pre, pre.dp, wl.input_len, wl.cached_prompt_tokens)
        # the low-rate TTFT: no queue, nothing to batch
        lone = prefill_point(m, hw, pre, 1, wl.input_len, wl.cached_prompt_tokens)
        rate = default_rate_pd(m, hw, pre, inst, wl, p_n, d_n) if a.rate is None else a.rate
        analytic = analytic_steady_state(m, hw, inst, wl, rate / d_n)
        n = a.num_requests or settling_requests(analytic)
        raw = run_pd(m, hw, pre, inst, wl, rate, n, p_n, d_n, a.arrival, a.length_dist,
                     a.max_num_seqs, a.max_num_batched_tokens, a.seed, groups=a.sim_dp_groups, proxy=proxy)
        cards = p_n * pre.cards + d_n * inst.cards
        res = summarize(raw, inst, a.tpot_ms, a.ttft_ms, window=(0.2, 0.9),
                        cards_per_group=cards / (d_n * inst.dp))
        pr = raw["prefill"]
        res["prefill"] = {"layout": layout(m, pre), "instances": p_n, "proxy": proxy, "steps": pr["steps"],
                          "busy_fraction": pr["busy_fraction"], "kv_pull_ms": raw["kv_pull_ms"]}
        res.update({"decode_instances": d_n, "cards": cards})
        pull = kv_pull_ms(m, hw, inst, wl.input_len, cards)
        # the decode instance computes the prompt's last token in its next step and samples token 1 there
        analytic |= {"ttft_ms": round(lone.ttft_ms + pull + (analytic["step_ms"] or 0.0), 3)}
    # Prompt tokens the engine's prefix cache served where prompts are computed (--prefix-cache-hit-rate).
    queries, hits = (raw["prefill"] if a.role == "pd" else raw)["prefix_cache"]
    res["prefix_cache_hit_rate"] = round(hits / queries, 4) if queries else 0.0
    res.update({"model": m.name, "hardware": hw.key, "rate_req_s": round(rate, 4), "num_requests": n,
                "arrival": a.arrival, "role": a.role, "length_dist": a.length_dist,
                "dp_groups_simulated": raw["groups"], "dp_groups": inst.dp, "analytic_steady_state": analytic})
    return res


def settling_requests(analytic: dict) -> int:
    """Requests per simulated group for a measurement past the warm-up, from analytic_steady_state(): a
    request lives about batch / rate-per-group, so 8 x the steady batch (the memory-limited one when
    overloaded) puts the measured 20-90% of the stream after the batch has filled (at least 200, at most
    4000)."""
    batch = analytic["batch_per_dp"] or analytic["max_batch_per_dp"]
    return min(4000, max(200, round(8 * batch)))


def simulate_plan(m: ModelSpec, hw: Hardware, plan: dict, wl: Workload, load: float,
                  num_requests: int | None, tpot_ms: float | None, ttft_ms: float | None, seed: int = 0) -> dict:
    """A `search` plan through the PD simulator at `load` x the plan's analytic request rate (Poisson,
    fixed lengths): the analytic plan assumes full prefill batches and a steady decode batch, the
    simulated stream shows what queueing does to TTFT and TPOT.

    num_requests per decode DP group; None: settling_requests() of the steady decode batch at that rate."""
    pre, dec = Instance(**plan["prefill"]["layout"]), Instance(**plan["decode"]["layout"])
    p_n, d_n = plan["prefill_instances"], plan["decode_instances"]
    rate = load * plan["requests_per_s"]
    if num_requests is None:
        num_requests = settling_requests(analytic_steady_state(m, hw, dec, wl, rate / d_n))
    # the prefill side batches what the plan's prefill batch holds (its memory check was made for it)
    raw = run_pd(m, hw, pre, dec, wl, rate, num_requests, p_n, d_n, seed=seed,
                 prefill_max_batched=plan["prefill"]["batch_per_dp"] * wl.input_len)
    res = summarize(raw, dec, tpot_ms, ttft_ms, window=(0.2, 0.9),
                    cards_per_group=plan["cards_used"] / (d_n * dec.dp))
    return {"load": load, "rate_req_s": round(rate, 4), "requests_per_decode_group": num_requests,
            "requests_measured": res["requests_measured"],
            "ttft_ms": res["ttft_ms"], "tpot_ms": res["tpot_ms"],
            "steady_tok_s_card": res["steady_tok_s_card"], "slo_met_fraction": res["slo_met_fraction"],
            "prefill_busy_fraction": raw["prefill"]["busy_fraction"]}


def format_report(r: dict) -> str:
    def row(name):
        d = {k: "-" if v is None else f"{v:.2f}" for k, v in r[name].items()}
        return f"  {name:<8} p50 {d['p50']:>9}  p90 {d['p90']:>9}  p99 {d['p99']:>9}  (ms)"
    a, p = r["analytic_steady_state"], r.get("prefill")
    return "\n".join([
        f"{r['model']} on {r['hardware']}: {r['rate_req_s']:.3f} req/s ({r['arrival']}, lengths "
        f"{r['length_dist']}), {r['requests_measured']} requests measured, {r['steps']} steps, "
        f"{r['preemptions']} preemptions; {r['dp_groups_simulated']} of {r['dp_groups']} DP groups simulated",
        row("ttft_ms"), row("tpot_ms"), row("itl_ms"),
        f"  throughput {r['throughput_tok_s_card']:.1f} tok/s/card over the run (steady "
        f"{'-' if r['steady_tok_s_card'] is None else format(r['steady_tok_s_card'], '.1f')}), goodput "
        f"{r['goodput_tok_s_card']:.1f}",
        (f"  analytic steady state: none, the rate is above the {a['capacity_req_s']} req/s decode sustains "
         f"at its memory-limited batch of {a['max_batch_per_dp']}/DP (queues grow)" if a.get("overloaded") else
         f"  analytic steady state: batch {a['batch_per_dp']}/DP, TPOT {a['tpot_ms']} ms")
        + (f"; TTFT {a['ttft_ms']} ms (a lone prompt + KV pull + a decode step)" if p else "")]
        + ([f"  prefill: {p['instances']} x {p['layout']['cards']} cards (TP{p['layout']['tp']}"
            + (f", {p['proxy']} proxy" if p["instances"] > 1 else "") + ") busy "
            f"{100 * p['busy_fraction']:.0f}%, KV pull {_pulls(p['kv_pull_ms'])}; decode: "
            f"{r['decode_instances']} instance(s); {r['cards']} cards in all"] if p else []))


def _pulls(by_len: dict) -> str:
    vals = list(by_len.values())
    return f"{vals[0]:.2f} ms" if len(vals) == 1 else f"{min(vals):.2f}-{max(vals):.2f} ms"
