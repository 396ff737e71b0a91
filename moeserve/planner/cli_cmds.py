"""Implementations of the `moeserve plan` subcommands (argument groups + text/JSON output)."""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import asdict

from moeserve.planner.cli_args import at_most, nonneg_int, positive_float, positive_int, positive_int_list
from moeserve.perf.deploy import MAX_INSTANCES, DoesNotFit, PlanError, fewest_redundant_slots
from moeserve.planner.cli import EXIT_REFUSED, _add_common, _ctx, _emit, cards


def _band_text(rng, unit: str) -> str:
    """' (documented efficiency ranges: lo..hi unit)', or '' when the hardware has no ranges."""
    return f" (efficiency ranges: {rng[0]:.0f}..{rng[1]:.0f} {unit})" if rng else ""


def _fmt_breakdown(br: dict) -> str:
    total = sum(v for k, v in br.items() if k != "overlap_saving")
    rows = [f"  {k:<22} {v:9.3f} ms  {100 * v / total:5.1f}%" for k, v in br.items() if v]
    return "\n".join(rows)


def args_estimate(p):
    _add_common(p)
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per DP group (default: max that fits)")
    p.add_argument("--prefill-requests", type=positive_int, default=None, help="default: one per DP group")
    _add_prefill_flags(p, "prefill instance (PD disaggregation; default: the decode layout)")
    _add_survival_flags(p)


def _add_prefill_flags(p, title: str):
    g = p.add_argument_group(title)
    g.add_argument("--prefill-cards", type=cards, default=None)
    g.add_argument("--prefill-tp", type=positive_int, default=None)
    g.add_argument("--prefill-moe-comm", choices=("alltoall", "allgather"), default=None)
    g.add_argument("--prefill-micro-batch-overlap", action="store_true")
    return g


def _prefill_instance(a, inst, m):
    """The prefill layout: --prefill-* flags, else the decode layout (MTP drafts kept: the prefill
    instance runs the MTP layer over the prompt for the decode instance)."""
    from moeserve.perf.deploy import Instance
    from moeserve.planner.memory import check_tp
    if a.prefill_tp is not None:
        check_tp(m, a.prefill_tp, "--prefill-tp")
    kw = {**asdict(inst), "tp": inst.tp if a.prefill_tp is None else a.prefill_tp,
          "moe_comm": a.prefill_moe_comm or inst.moe_comm, "micro_batch_overlap": a.prefill_micro_batch_overlap}
    if a.prefill_cards is not None:  # a separate instance: no dedicated shared ranks, fewest redundant slots
        kw.update(cards=a.prefill_cards, shared_expert_ranks=0,
                  redundant_experts=fewest_redundant_slots(m.n_routed_experts, a.prefill_cards))
    if kw["cards"] % kw["tp"]:  # Instance would name --cards / --tp, the decode layout's flags
        cards_flag = "--cards" if a.prefill_cards is None else "--prefill-cards"
        tp_flag = "--tp" if a.prefill_tp is None else "--prefill-tp"
        raise PlanError(f"{cards_flag} {kw['cards']} not divisible by prefill attention TP {kw['tp']}; "
                        f"make {cards_flag} a multiple of {tp_flag}")
    inst = Instance(**kw)
    return a.load_skew.apply(inst) if a.load_skew else inst  # its own EP size and spare slots


@contextmanager
def _which(label: str):
    """estimate prices two layouts: say which one a refusal is about."""
    try:
        yield
    except PlanError as e:
        raise type(e)(f"{label}: {e}") from None


def cmd_estimate(a):
    from moeserve.planner.analysis import band, decode_point, kv_pull_ms, layout, prefill_point, require_fits
    m, hw, inst, wl = _ctx(a)
    with _which(f"decode instance ({inst.cards} cards)"):
        mem = require_fits(m, hw, inst, wl)
        if a.batch is not None and inst.max_num_seqs is not None and a.batch > inst.max_num_seqs:
            raise PlanError(f"--batch {a.batch} exceeds --max-num-seqs {inst.max_num_seqs}; raise --max-num-seqs "
                            f"or use --batch <= {inst.max_num_seqs}")
        if a.batch is not None and a.batch > mem.max_batch:
            raise DoesNotFit(f"--batch {a.batch} does not fit: KV room for {mem.max_batch} sequences per DP "
                             f"group at mean context {wl.mean_decode_context:.0f}; use --batch <= {mem.max_batch}")
        batch = mem.max_batch if a.batch is None else a.batch
        pt = decode_point(m, hw, inst, wl, batch)
        pt_band = band(lambda h: decode_point(m, h, inst, wl, batch).tok_s_card, hw)
        surv = _survival(a, m, hw, inst, wl)
    separate = a.prefill_cards is not None
    with _which(f"prefill instance ({a.prefill_cards} cards)" if separate
                else f"prefill on the decode layout ({inst.cards} cards)"):
        pre_inst = _prefill_instance(a, inst, m)
        requests = pre_inst.dp if a.prefill_requests is None else a.prefill_requests
        pre = prefill_point(m, hw, pre_inst, requests, wl.input_len, wl.cached_prompt_tokens)
        pre_band = band(lambda h: prefill_point(m, h, pre_inst, requests, wl.input_len,
                                                wl.cached_prompt_tokens).ttft_ms, hw)
    # PD balance: requests/s one decode instance finishes vs one prefill instance starts.
    dec_req = pt.tok_s_card * inst.cards / wl.output_len
    pre_req = pre.tok_s_card * pre_inst.cards / wl.input_len
    # A separate prefill instance hands each prompt's KV to the decode instance before its first step.
    pull = kv_pull_ms(m, hw, inst, wl.input_len, inst.cards + pre_inst.cards) if separate else 0.0
    obj = {"model": m.name, "hardware": hw.key, "layout": layout(m, inst),
           "decode": {**pt.to_dict(), "band_tok_s_card": pt_band},
           "memory": mem.to_dict(), "prefill_layout": layout(m, pre_inst),
           "prefill": {**pre.to_dict(), "band_ttft_ms": pre_band},
           "prefill_instances_per_decode_instance": round(dec_req / pre_req, 3),
           "kv_pull_ms": round(pull, 3), "ttft_with_kv_pull_ms": round(pre.ttft_ms + pull, 3)}
    if surv is not None:
        obj["survival"] = surv.to_dict()
    text = (f"{m.name} on {hw.name}, {inst.cards} cards (DP{inst.dp} x TP{inst.tp}, EP{inst.ep}), "
            f"context {wl.mean_decode_context:.0f}\n"
            f"decode batch {batch}/DP: step {pt.step_ms:.2f} ms, TPOT {pt.tpot_ms:.2f} ms, "
            f"{pt.tok_s_card:.0f} tok/s/card{_band_text(pt_band, 'tok/s/card')}, HBM {100 * pt.hbm_util:.0f}% of peak\n"
            f"{_fmt_breakdown(pt.breakdown_ms)}\n"
            f"memory/card: weights {mem.weights / 2**30:.1f} GiB, KV room {mem.kv_free / 2**30:.1f} GiB, "
            f"max batch {mem.max_batch}/DP\n"
            f"prefill ({pre_inst.cards} cards, TP{pre_inst.tp}) {pre.requests} x {pre.length}: TTFT "
            f"{pre.ttft_ms:.1f} ms{_band_text(pre_band, 'ms')}, {pre.tok_s_card:.0f} tok/s/card; "
            f"{dec_req / pre_req:.2f} prefill instances per decode instance"
            + (f"\nKV pull to decode {pull:.1f} ms per request: TTFT {pre.ttft_ms + pull:.1f} ms" if pull else "")
            + ("\n" + "\n".join(_survival_text(surv)) if surv is not None else ""))
    return _emit(a, obj, text)


def _survival(a, m, hw, inst, wl):
    """The decode instance's survival report (--elastic-ep-losses N > 0), else None; a layout that cannot
    survive is refused (DoesNotFit, exit 1) naming the flag."""
    from moeserve.planner.memory import survival_report
    if not a.elastic_ep_losses:
        return None
    surv = survival_report(m, hw, inst, wl, a.elastic_ep_losses, a.cards_per_node)
    if surv.reason:
        raise DoesNotFit(f"--elastic-ep-losses {a.elastic_ep_losses}: {surv.reason}")
    return surv


def args_decode(p):
    _add_common(p)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--tpot-ms", type=positive_float, default=None, help="TPOT SLO (default 50)")
    target.add_argument("--batch-per-device", type=positive_int, default=None,
                        help="price the batch a deployment states (sequences each card runs) instead of a TPOT SLO")
    p.add_argument("--plot", help="write the throughput-vs-TPOT plot here (.png added when the name has no suffix)")


def cmd_decode(a):
    from moeserve.planner.analysis import band, best_under_slo, decode_curve, layout
    from moeserve.planner.plots import plot_curves, plot_path
    m, hw, inst, wl = _ctx(a)
    plot = plot_path(a.plot) if a.plot is not None else None  # before the work: a bad path loses nothing
    if a.batch_per_device is not None:
        return _decode_at_batch(a, m, hw, inst, wl, plot)
    a.tpot_ms = 50.0 if a.tpot_ms is None else a.tpot_ms
    curve = decode_curve(m, hw, inst, wl)
    best = best_under_slo(m, hw, inst, wl, a.tpot_ms)
    # A factor set under which no batch meets the SLO counts as 0 tok/s/card.
    rng = band(lambda h: getattr(best_under_slo(m, h, inst, wl, a.tpot_ms), "tok_s_card", 0.0), hw)
    if plot:
        plot_curves({f"{hw.key} {inst.cards} cards": curve}, plot, tpot_slo_ms=a.tpot_ms)
    obj = {"model": m.name, "hardware": hw.key, "layout": layout(m, inst),
           "curve": [{k: v for k, v in p.to_dict().items() if k != "breakdown_ms"} for p in curve],
           "best_under_slo": best.to_dict() if best else None, "best_band_tok_s_card": rng,
           "tpot_slo_ms": a.tpot_ms, "plot": plot}
    lines = [f"{'batch/DP':>8} {'TPOT ms':>9} {'tok/s/card':>11}"]
    lines += [f"{p.batch:>8} {p.tpot_ms:>9.2f} {p.tok_s_card:>11.0f}" for p in curve]
    lines.append(f"best under TPOT <= {a.tpot_ms:g} ms: " + (
        f"batch {best.batch}/DP, {best.tok_s_card:.0f} tok/s/card at {best.tpot_ms:.1f} ms" if best
        else "none (TPOT at batch 1 already exceeds the SLO)") + _band_text(rng, "tok/s/card"))
    if plot:
        lines.append(f"wrote {plot}")
    return _emit(a, obj, "\n".join(lines))


def _decode_at_batch(a, m, hw, inst, wl, plot):
    """`decode --batch-per-device B`: the stated operating point, not the best one under an SLO."""
    from moeserve.planner.analysis import band, decode_at_batch, decode_curve, decode_point, layout
    from moeserve.planner.plots import plot_curves
    pt = decode_at_batch(m, hw, inst, wl, a.batch_per_device)
    rng = band(lambda h: decode_point(m, h, inst, wl, a.batch_per_device).tok_s_card, hw)
    if plot:
        plot_curves({f"{hw.key} {inst.cards} cards": decode_curve(m, hw, inst, wl)}, plot)
    obj = {"model": m.name, "hardware": hw.key, "layout": layout(m, inst), "batch_per_device": a.batch_per_device,
           "at_batch": pt.to_dict(), "band_tok_s_card": rng, "plot": plot}
    text = (f"batch {pt.batch}/device: step {pt.step_ms:.2f} ms, TPOT {pt.tpot_ms:.2f} ms, {pt.tok_s_card:.0f} "
            f"tok/s/card{_band_text(rng, 'tok/s/card')}\n{_fmt_breakdown(pt.breakdown_ms)}"
            + (f"\nwrote {plot}" if plot else ""))
    return _emit(a, obj, text)


def args_prefill(p):
    _add_common(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=positive_int, default=None,
                      help="prompts per batch (default: one per DP group)")
    size.add_argument("--tokens-per-device", type=positive_int, default=None,
                      help="prompt tokens one forward carries per card (a published prefill's figure); "
                           "requests = this x cards / --input-len")


def cmd_prefill(a):
    from moeserve.planner.analysis import band, layout, prefill_point
    from moeserve.planner.analysis import requests_for_tokens
    m, hw, inst, wl = _ctx(a)
    requests = inst.dp if a.requests is None else a.requests
    if a.tokens_per_device is not None:
        requests = requests_for_tokens(inst, a.tokens_per_device, wl.input_len)
    pt = prefill_point(m, hw, inst, requests, wl.input_len, wl.cached_prompt_tokens)
    rng = band(lambda h: prefill_point(m, h, inst, requests, wl.input_len, wl.cached_prompt_tokens).ttft_ms, hw)
    text = (f"prefill {pt.requests} x {pt.length} on {inst.cards} cards: TTFT {pt.ttft_ms:.1f} ms"
            f"{_band_text(rng, 'ms')}, {pt.tok_s_card:.0f} tok/s/card\n{_fmt_breakdown(pt.breakdown_ms)}")
    return _emit(a, {"model": m.name, "hardware": hw.key, "layout": layout(m, inst), **pt.to_dict(),
                     "band_ttft_ms": rng}, text)


def args_memory(p):
    _add_common(p)
    _add_survival_flags(p)


def _add_survival_flags(p):
    g = p.add_argument_group("surviving rank losses (moeserve --enable-elastic-ep)")
    g.add_argument("--elastic-ep-losses", "--survive-losses", dest="elastic_ep_losses", type=nonneg_int, default=0,
                   metavar="N", help="also size the layout after N lost DP groups: experts per surviving card, "
                   "degraded KV capacity, redundant slots or host copy that refill the lost experts; a layout "
                   "that cannot survive is refused (exit 1). Default 0: the healthy layout only")
    g.add_argument("--cards-per-node", type=positive_int, default=None,
                   help="cards sharing one host's memory, for the host-copy size (default: the scale-up domain)")


def _survival_text(s) -> list[str]:
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    lines = [f"after {s.losses} lost DP group(s) ({s.lost_cards} card(s)):"]
    if s.degraded is not None:
        d = s.degraded
        lines.append(f"  {s.survivors} expert cards, {s.slots_before} -> {s.slots_after} routed experts per card "
                     f"(redundant {s.redundant_have} -> {s.redundant_after}); weights {gib(d.weights)}, KV room "
                     f"{gib(d.kv_free)} -> max batch {d.max_batch}/DP, {s.degraded_sequences} sequences "
                     f"(healthy {s.healthy_sequences}{'' if s.carries_load else ': the rest wait for KV room'})")
    rep = s.replicated
    if s.replicas_cover:
        lines.append(f"  refill from replicas: the {s.redundant_have} redundant slots give every expert "
                     f"{s.losses + 1} copies (placed on distinct DP groups)")
    else:
        fit = (f"REFUSED: {s.replicated_reason}" if s.replicated_reason else
               f"weights {gib(rep.weights)}, max batch {rep.max_batch}/DP (healthy {s.healthy.max_batch})")
        lines.append(f"  refill from replicas needs --redundant-experts {s.redundant_needed} (have "
                     f"{s.redundant_have}; {s.losses + 1} copies of every expert on distinct DP groups): {fit}")
        lines.append(f"  else a host copy: {gib(s.host_copy_node)} per node of {s.cards_per_node} cards"
                     f"{'' if s.node_given else ' (the scale-up domain; else give --cards-per-node)'}, "
                     f"{gib(s.host_copy_card)} per card; else the checkpoint ({gib(s.host_copy_card)} per lost card)")
    lines.append(f"REFUSED (cannot survive): {s.reason}" if s.reason else f"survives {s.losses} loss(es)")
    return lines


def cmd_memory(a):
    from moeserve.planner.analysis import decode_memory
    from moeserve.planner.memory import refusal_reason, survival_report
    m, hw, inst, wl = _ctx(a)
    rep = decode_memory(m, hw, inst, wl)
    reason = refusal_reason(m, hw, inst, rep)
    obj = {**rep.to_dict(), "refused": reason}
    d = rep.to_dict()
    lines = [f"  {k:<14} {v:8.2f} GiB" for k, v in d["weights_detail_gib"].items()] + [
        f"usable {d['usable_gib']:.1f} GiB, weights {d['weights_gib']:.1f}, activations "
        f"{d['activations_gib']:.2f}, KV room {d['kv_free_gib']:.1f} -> max batch {rep.max_batch}/DP",
        f"REFUSED: {reason}" if reason else "fits"]
    if a.elastic_ep_losses and not reason:
        surv = survival_report(m, hw, inst, wl, a.elastic_ep_losses, a.cards_per_node)
        obj["survival"] = surv.to_dict()
        lines += _survival_text(surv)
        if surv.reason:
            obj["refused"] = reason = f"--elastic-ep-losses {a.elastic_ep_losses}: {surv.reason}"
    _emit(a, obj, "\n".join(lines))
    return EXIT_REFUSED if reason else 0


def args_search(p):
    _add_common(p)
    p.add_argument("--tpot-ms", type=positive_float, default=50.0)
    p.add_argument("--ttft-ms", type=positive_float, default=None)
    p.add_argument("--top", type=positive_int, default=5)
    _add_survival_flags(p)
    g = p.add_argument_group("check plans with the simulator")
    g.add_argument("--simulate", type=positive_int, default=None, metavar="N",
                   help="run the best N plans through `plan simulate --role pd` (Poisson arrivals)")
    g.add_argument("--simulate-load", type=_load_fraction, default=0.8,
                   help="simulated rate as a fraction of each plan's analytic request rate (0, 1]")
    g.add_argument("--simulate-requests", type=positive_int, default=None,
                   help="requests per simulated decode DP group (default as simulate --num-requests)")


def _load_fraction(text: str) -> float:
    x = positive_float(text)
    if x > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a fraction of the plan's rate), got {text}")
    return x


def cmd_search(a):
    from moeserve.planner.search import search
    from moeserve.planner.sim_plan import simulate_plan
    if a.simulate is None and (a.simulate_requests is not None or a.simulate_load != 0.8):
        flag = "--simulate-requests" if a.simulate_requests is not None else "--simulate-load"
        raise PlanError(f"{flag} sets up the plan simulation; add --simulate N")
    m, hw, inst, wl = _ctx(a)
    res = search(m, hw, a.cards, wl, a.tpot_ms, inst, a.ttft_ms, a.top, skew=a.load_skew,
                 survive_losses=a.elastic_ep_losses, cards_per_node=a.cards_per_node)
    for pl in res["plans"][:a.simulate or 0]:
        try:
            pl["simulated"] = simulate_plan(m, hw, pl, wl, a.simulate_load, a.simulate_requests, a.tpot_ms,
                                            a.ttft_ms)
        except DoesNotFit as e:  # one plan the scheduler cannot run does not lose the whole search
            pl["simulated"] = {"refused": str(e)}
    lines = [f"{len(res['plans'])} plans for {a.cards} cards of {hw.key}, TPOT <= {a.tpot_ms:g} ms"
             + (f": {res['refused']}" if not res["plans"] else "")]
    for i, pl in enumerate(res["plans"], 1):
        d, p = pl["decode"], pl["prefill"]
        rng = pl["band_goodput_tok_s_card"]
        lines.append(f"{i}. {pl['goodput_tok_s_card']:.0f} tok/s/card goodput"
                     + (f" ({rng[0]:.0f}..{rng[1]:.0f} over the efficiency ranges)" if rng else "") + ": "
                     f"{pl['prefill_instances']} x prefill {_lay(p)} : {pl['decode_instances']} x decode "
                     f"{_lay(d)} ({pl['prefill_cards']}:{pl['decode_cards']} cards)")
        if "survival" in d:
            sv = d["survival"]
            refill = ("replicas held" if sv["replicas_cover"] else
                      f"--redundant-experts {sv['redundant_for_replicas']} for replicas, else a host copy of "
                      f"{sv['host_copy_gib_per_node']:.1f} GiB per node")
            lines.append(f"   decode after {sv['losses']} loss(es): {sv['experts_per_card_after']} experts per card, "
                         f"{sv['degraded_sequences']} of {sv['healthy_sequences']} sequences; refill: {refill}")
        if "refused" in pl.get("simulated", {}):
            lines.append(f"   not simulated: {pl['simulated']['refused']}")
        elif "simulated" in pl:
            sim = pl["simulated"]
            ttft, tpot = (f"{_num(d['p50'], p)}/{_num(d['p99'], p)}" for d, p in ((sim["ttft_ms"], 0),
                                                                                  (sim["tpot_ms"], 1)))
            lines.append(f"   simulated at {100 * sim['load']:.0f}% ({sim['rate_req_s']:g} req/s): TTFT p50/p99 "
                         f"{ttft} ms (analytic {pl['ttft_with_kv_pull_ms']:.0f}), TPOT p50/p99 {tpot} ms, "
                         f"{_num(sim['steady_tok_s_card'], 0)} tok/s/card steady, "
                         f"{100 * (sim['slo_met_fraction'] or 0):.0f}% of requests within the SLO, prefill busy "
                         f"{100 * sim['prefill_busy_fraction']:.0f}%")
    _emit(a, res, "\n".join(lines))
    return 0 if res["plans"] else EXIT_REFUSED


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _lay(c: dict) -> str:
    l = c["layout"]
    extra = f", {l['shared_expert_ranks']} shared" if l["shared_expert_ranks"] else ""
    tbo = ", overlap" if l["micro_batch_overlap"] else ""
    fc = f", flashcomm {l['flashcomm']}" if l["flashcomm"] != "off" else ""
    return f"[{l['cards']} cards TP{l['tp']} {l['moe_comm']}{extra}{tbo}{fc}, batch {c['batch_per_dp']}]"


def args_simulate(p):
    from moeserve.planner.simulate import PROXIES
    _add_common(p)
    p.add_argument("--rate", type=positive_float, default=None, help="requests/s into the instance (Poisson)")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="per simulated DP group (default: 8 x the analytic steady batch, at least 200, so the "
                        "measured 20-90%% of the stream is past the warm-up)")
    p.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    p.add_argument("--length-dist", choices=("fixed", "uniform", "exponential"), default="fixed")
    # --max-num-seqs (per DP group, default: the memory limit) is a common instance flag (cli._add_common)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--tpot-ms", type=positive_float, default=None, help="goodput SLO on TPOT")
    p.add_argument("--ttft-ms", type=positive_float, default=None, help="goodput SLO on TTFT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-dp-groups", type=positive_int, default=1,
                   help="DP groups simulated in lockstep (must divide the DP size; default 1: every group "
                        "carries the same load). More show the wait for the slowest group, at that many times "
                        "the run time")
    p.add_argument("--role", choices=("unified", "decode", "pd"), default="unified",
                   help="decode: a PD decode instance (prompts arrive with their KV); pd: a prefill and a decode "
                        "instance behind a proxy (needs --prefill-cards)")
    g = _add_prefill_flags(p, "PD deployment (--role pd; the deployment flags above are the decode instance)")
    instances = at_most(MAX_INSTANCES, "instances a PD simulation runs")
    g.add_argument("--prefill-instances", type=instances, default=1)
    g.add_argument("--decode-instances", type=instances, default=1)
    g.add_argument("--pd-proxy", choices=PROXIES, default=None,
                   help="how the proxy spreads prompts over prefill instances (default least-loaded: the shortest "
                        "estimated TTFT, as the published design's proxy does)")


def cmd_simulate(a):
    from moeserve.planner.sim_plan import format_report, simulate_from_args
    m, hw, inst, wl = _ctx(a)
    pre = None
    if a.role == "pd":
        if a.prefill_cards is None:
            raise PlanError("--role pd needs --prefill-cards (the prefill instance's size)")
        with _which(f"prefill instance ({a.prefill_cards} cards)"):
            pre = _prefill_instance(a, inst, m)
    else:
        used = [f for f in ("prefill_cards", "prefill_tp", "prefill_moe_comm", "pd_proxy")
                if getattr(a, f) is not None]
        used += [f for f in ("prefill_micro_batch_overlap",) if getattr(a, f)]
        used += [f for f in ("prefill_instances", "decode_instances") if getattr(a, f) != 1]
        if used:
            raise PlanError(f"--{used[0].replace('_', '-')} describes a PD deployment; add --role pd")
    res = simulate_from_args(a, m, hw, inst, wl, pre)
    return _emit(a, res, format_report(res))


def args_validate(p):
    from moeserve.perf.hardware import PROFILES
    p.add_argument("--hardware-file", help="YAML/JSON with extra devices/systems/efficiency")
    p.add_argument("--efficiency-profile", choices=PROFILES, default=None,
                   help="profile for `predicted` (default end_to_end); rows also carry predicted_kernel")
    p.add_argument("--cases", metavar="FILE",
                   help="YAML/JSON of your own published or measured results instead of the built-in ones "
                        "(docs/planner.md 'Your own cases')")
    p.add_argument("--feasibility", action="store_true",
                   help="also search the documented efficiency ranges for the factor set with the smallest "
                        "worst-case error (an analysis: predictions keep the point values)")
    p.add_argument("--leave-one-out", action="store_true",
                   help="also predict each case alone and with the others' published values changed (nothing "
                        "may move: no factor is fitted to the rows)")
    p.add_argument("--json", action="store_true")


def cmd_validate(a):
    from moeserve.planner.calibrate import (feasibility, format_feasibility, format_leave_one_out, format_table,
                                            leave_one_out, validate)
    res = validate(a.hardware_file, a.efficiency_profile, a.cases)
    text = format_table(res)
    if a.leave_one_out:
        res["leave_one_out"] = leave_one_out(a.hardware_file, a.efficiency_profile, a.cases)
        text += "\n" + format_leave_one_out(res["leave_one_out"])
    if a.feasibility:
        res["feasibility"] = feasibility(a.hardware_file, a.efficiency_profile, cases_file=a.cases)
        text += "\n" + format_feasibility(res["feasibility"])
    return _emit(a, res, text)


def args_layers(p):
    _add_common(p)
    p.add_argument("--batch", type=positive_int, required=True, help="sequences per DP group")
    p.add_argument("--context", type=positive_int, default=None, help="KV length (default: --input-len)")


def cmd_layers(a):
    from moeserve.planner.layers import format_breakdown, layer_breakdown
    m, hw, inst, wl = _ctx(a)
    res = layer_breakdown(m, hw, inst, a.batch, a.context or wl.input_len)
    return _emit(a, res, format_breakdown(res))


def args_hardware(p):
    from moeserve.perf.hardware import PROFILES
    p.add_argument("--hardware-file")
    p.add_argument("--efficiency-profile", choices=PROFILES, default=None)
    p.add_argument("--json", action="store_true")


def cmd_hardware(a):
    from moeserve.perf.hardware import HardwareDB
    db = HardwareDB(a.hardware_file, a.efficiency_profile)
    hws = {n: db.get(n) for n in db.names()}
    obj = {n: {**{k: v for k, v in asdict(h).items() if k != "eff"}, "efficiency": asdict(h.eff)}
           for n, h in hws.items()}
    lines = [f"{'name':<24} {'bf16':>6} {'int8':>6} {'HBM GiB':>8} {'TB/s':>5} {'up GB/s':>8} "
             f"{'domain':>6} {'out GB/s':>8}"]
    lines += [f"{n:<24} {h.bf16_tflops:>6.0f} {h.int8_tops:>6.0f} {h.hbm_gib:>8.0f} {h.hbm_tbps:>5.2f} "
              f"{h.scale_up_gbps:>8.0f} {h.scale_up_domain:>6} {h.scale_out_gbps:>8.0f}" for n, h in hws.items()]
    return _emit(a, obj, "\n".join(lines))


def args_profile_cpu(p):
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", action="store_true",
                   help="also run moeserve's CPU engine on the bench model and compare")
    p.add_argument("--batches", type=positive_int_list, default=[1, 4, 16], help="decode batch sizes")
    p.add_argument("--threads", type=at_most(1024, "torch threads"), default=None)
    p.add_argument("--eager", action="store_true",
                   help="measure and price the eager decode step instead of the compiled one (the default)")



def cmd_profile_cpu(a):
    from moeserve.planner.cpucheck import format_report, run_check
    res = run_check(a.batches, measure=a.measure, threads=a.threads, eager=a.eager)
    return _emit(a, res, format_report(res))
