"""Layout search: enumerate prefill and decode instances and the prefill:decode split, rank by goodput/card.

Goodput per card = requests/s the whole deployment sustains with decode inside the TPOT SLO (and prefill
inside the TTFT SLO when given), times output_len, divided by all cards used (prefill + decode). The TTFT
a PD deployment's client sees is the prefill batch plus the decode instance's pull of the prompt's KV.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from moeserve.planner.analysis import band, best_under_slo, kv_pull_ms, layout, prefill_point
from moeserve.perf.deploy import DoesNotFit, Instance, PlanError, Workload, fewest_redundant_slots
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec
from moeserve.planner.memory import SurvivalReport, survival_report

SIZES = (8, 16, 24, 32, 48, 64, 72, 96, 128, 144, 160, 192, 256, 288, 320, 384)
TPS = (1, 2, 4, 8)


def _flashcomm_options(tp: int) -> tuple[str, ...]:
    """With attention TP, also try FlashComm with the INT8 AllGather (moeserve --flashcomm int8)."""
    return ("off", "int8") if tp > 1 else ("off",)


@dataclass
class Candidate:
    role: str
    inst: Instance
    tok_s_card: float    # decode: output tok/s/card at the SLO; prefill: input tok/s/card
    latency_ms: float    # decode: TPOT; prefill: TTFT of one batch
    batch: int
    survival: SurvivalReport | None = None  # search --elastic-ep-losses N

    def to_dict(self, m: ModelSpec) -> dict:
        d = layout(m, self.inst)
        out = {"role": self.role, "layout": d, "tok_s_card": round(self.tok_s_card, 1),
               "latency_ms": round(self.latency_ms, 2), "batch_per_dp": self.batch}
        if self.survival is not None:
            s = self.survival.to_dict()
            out["survival"] = {k: s[k] for k in (
                "losses", "experts_per_card_after", "degraded_sequences", "healthy_sequences",
                "redundant_for_replicas", "replicas_cover", "host_copy_gib_per_node")}
        return out


def decode_layouts(m: ModelSpec, hw: Hardware, cards: int, base: Instance, skew=None):
    """skew: eplb_stats.LoadSkew giving each layout the imbalance of its own EP size and spare slots
    (None: every layout keeps base.imbalance, a residual skew)."""
    for size in (s for s in SIZES if s <= cards):
        for tp in (t for t in TPS if size % t == 0 and t <= hw.scale_up_domain):
            shared_opts = {0}
            if m.n_shared_experts and size >= 18 and size % 9 == 0:
                shared_opts.add(size // 9)  # CloudMatrix-style: 1 of 9 ranks holds shared experts
            for shared in shared_opts:
                red = fewest_redundant_slots(m.n_routed_experts, size - shared)
                for comm in ("alltoall", "allgather"):
                    for tbo in (False, True):
                        for fc in _flashcomm_options(tp):
                            inst = replace(base, cards=size, tp=tp, shared_expert_ranks=shared,
                                           redundant_experts=red, moe_comm=comm, micro_batch_overlap=tbo,
                                           flashcomm=fc)
                            yield skew.apply(inst) if skew else inst


def _refusal(err: PlanError) -> str:
    return "memory" if isinstance(err, DoesNotFit) else "layout"


def best_decode(m, hw, cards, base, wl, tpot_ms, top=5, skew=None, tally: Counter | None = None,
                survive_losses: int = 0, cards_per_node: int | None = None) -> list[Candidate]:
    """tally: counts layouts by outcome (fit, memory, layout, tpot, survive), to say why a search found
    nothing; survive_losses: drop layouts whose survivors of that many lost DP groups do not fit in memory
    (memory.survival_report), and give the others' survival summary."""
    out, tally = [], Counter() if tally is None else tally
    for inst in decode_layouts(m, hw, cards, base, skew):
        try:
            pt = best_under_slo(m, hw, inst, wl, tpot_ms)
        except PlanError as err:
            tally[_refusal(err)] += 1
            continue
        surv = None
        if pt and survive_losses:
            surv = survival_report(m, hw, inst, wl, survive_losses, cards_per_node)
            if not surv.survives:
                tally["survive"] += 1
                continue
        tally["fit" if pt else "tpot"] += 1  # None: TPOT at batch 1 already over the SLO
        if pt:
            out.append(Candidate("decode", inst, pt.tok_s_card, pt.tpot_ms, pt.batch, surv))
    return sorted(out, key=lambda c: -c.tok_s_card)[:top]


def best_prefill(m, hw, cards, base, wl, ttft_ms=None, top=5, kv_pull=0.0, skew=None,
                 tally: Counter | None = None) -> list[Candidate]:
    """kv_pull: ms the decode side needs to pull one prompt's KV, counted against the TTFT SLO; skew: as in
    decode_layouts; tally: as in best_decode (fit, memory, layout, ttft)."""
    out, tally = [], Counter() if tally is None else tally
    for size in (s for s in SIZES if s <= cards):
        for tp, fcs, dense in _prefill_tps(m, hw, size):
            red = fewest_redundant_slots(m.n_routed_experts, size)
            for comm in ("alltoall", "allgather"):
                for fc in fcs:
                    inst = replace(base, cards=size, tp=tp, redundant_experts=red, moe_comm=comm,
                                   shared_expert_ranks=0, micro_batch_overlap=False,  # MTP kept: step.py
                                   flashcomm=fc, dense_tp=dense)
                    inst = skew.apply(inst) if skew else inst
                    cand = _prefill_candidate(m, hw, inst, wl, ttft_ms, kv_pull, tally)
                    if cand:
                        out.append(cand)
    return sorted(out, key=lambda c: -c.tok_s_card)[:top]


def _prefill_tps(m, hw, size: int):
    """(attention TP, FlashComm options, dense TP) a prefill instance of `size` cards may run: TP inside one
    scale-up domain, and TP over two domains with sequence parallelism (FlashComm INT8) and the dense MLP
    inside a domain, the published Atlas 800I A2 prefill's layout (hardware.md: TP16, dense TP8)."""
    for tp in (t for t in TPS if size % t == 0 and t <= hw.scale_up_domain):
        yield tp, _flashcomm_options(tp), None
    wide = 2 * hw.scale_up_domain
    if wide not in TPS and size % wide == 0 and m.num_attention_heads % wide == 0:
        yield wide, ("int8",), hw.scale_up_domain


def _prefill_candidate(m, hw, inst, wl, ttft_ms, kv_pull=0.0, tally: Counter | None = None, max_per_dp: int = 64):
    """Largest batch (one prompt per DP group, doubling up to `max_per_dp`) that fits and meets the TTFT SLO;
    tally counts the layout's outcome at its first batch."""
    best, per_dp, tally = None, 1, Counter() if tally is None else tally
    while per_dp <= max_per_dp:
        try:
            pt = prefill_point(m, hw, inst, per_dp * inst.dp, wl.input_len, wl.cached_prompt_tokens)
        except PlanError as err:
            tally[_refusal(err)] += per_dp == 1
            break
        if ttft_ms is not None and pt.ttft_ms + kv_pull > ttft_ms:
            tally["ttft"] += per_dp == 1
            break
        tally["fit"] += per_dp == 1
        if best is None or pt.tok_s_card > best.tok_s_card:
            best = Candidate("prefill", inst, pt.tok_s_card, pt.ttft_ms, per_dp)
        per_dp *= 2
    return best


def split(cards: int, dec: Candidate, pre: Candidate, wl: Workload) -> dict | None:
    """Best integer numbers of prefill and decode instances within `cards`, by goodput per card."""
    dec_req = dec.tok_s_card * dec.inst.cards / wl.output_len   # requests/s per decode instance
    pre_req = pre.tok_s_card * pre.inst.cards / wl.input_len    # requests/s per prefill instance
    best = None
    for n_dec in range(1, cards // dec.inst.cards + 1):
        left = cards - n_dec * dec.inst.cards
        # Goodput per card rises with the prefill instances up to the balance point and falls after it, so
        # the best count is one of its two integer neighbours (the lower one leaves decode some headroom).
        balance = n_dec * dec_req / pre_req
        for n_pre in sorted({min(left // pre.inst.cards, n) for n in (math.floor(balance), math.ceil(balance))}):
            if n_pre < 1:
                continue
            used = n_dec * dec.inst.cards + n_pre * pre.inst.cards
            req_s = min(n_dec * dec_req, n_pre * pre_req)
            goodput = req_s * wl.output_len / used
            if best is None or goodput > best["goodput_tok_s_card"]:
                best = {"prefill_instances": n_pre, "decode_instances": n_dec, "cards_used": used,
                        "prefill_cards": n_pre * pre.inst.cards, "decode_cards": n_dec * dec.inst.cards,
                        "requests_per_s": round(req_s, 3), "goodput_tok_s_card": round(goodput, 1)}
    return best


def search(m: ModelSpec, hw: Hardware, cards: int, wl: Workload, tpot_ms: float, base: Instance,
           ttft_ms: float | None = None, top: int = 5, skew=None, survive_losses: int = 0,
           cards_per_node: int | None = None) -> dict:
    dec_tally, pre_tally = Counter(), Counter()
    decs = best_decode(m, hw, cards, base, wl, tpot_ms, top=None, skew=skew, tally=dec_tally,
                       survive_losses=survive_losses, cards_per_node=cards_per_node)
    pull = kv_pull_ms(m, hw, base, wl.input_len, cards)  # every instance within `cards`
    pres = best_prefill(m, hw, cards, base, wl, ttft_ms, top=None, kv_pull=pull, skew=skew, tally=pre_tally)
    plans = []
    # Pair the best layout of every instance size: the overall top decode layouts may be too big to leave
    # room for any prefill instance (e.g. 32-card decode on 32 cards), while a smaller pair fits.
    for d in _best_per_size(decs):
        for p in _best_per_size(pres):
            s = split(cards, d, p, wl)
            if s:
                plans.append(({**s, "decode": d.to_dict(m), "prefill": p.to_dict(m),
                               "ttft_with_kv_pull_ms": round(p.latency_ms + pull, 2)}, d, p))
    plans.sort(key=lambda p: -p[0]["goodput_tok_s_card"])
    for plan, d, p in plans[:top]:
        plan["band_goodput_tok_s_card"] = band(
            lambda h: plan_goodput(m, h, plan, d, p, wl, tpot_ms, ttft_ms, cards), hw)
    plans = [plan for plan, _, _ in plans]
    res = {"cards": cards, "tpot_ms": tpot_ms, "ttft_ms": ttft_ms, "kv_pull_ms": round(pull, 3),
           "plans": plans[:top],
           "decode_candidates": [d.to_dict(m) for d in decs[:top]],
           "prefill_candidates": [p.to_dict(m) for p in pres[:top]],
           "layouts_tried": {"decode": dict(dec_tally), "prefill": dict(pre_tally)}}
    if not plans:
        res["refused"] = no_plan_reason(cards, tpot_ms, ttft_ms, dec_tally, pre_tally, decs, pres)
    return res


def plan_goodput(m: ModelSpec, hw: Hardware, plan: dict, dec: Candidate, pre: Candidate, wl: Workload,
                 tpot_ms: float, ttft_ms: float | None = None, cards: int | None = None) -> float:
    """The plan's goodput per card on `hw` with its instance counts kept (what was deployed): decode at the
    largest batch inside the TPOT SLO there (0 if none), prefill at the best of the search's batches up to
    the plan's (at the point values: the plan's own), with a TTFT SLO only those whose TTFT plus the KV pull
    within `cards` meets it there (0 if none). What `band` varies the efficiency factors of."""
    pt = best_under_slo(m, hw, dec.inst, wl, tpot_ms)
    dec_req = (pt.tok_s_card if pt else 0.0) * dec.inst.cards / wl.output_len
    pull = kv_pull_ms(m, hw, dec.inst, wl.input_len, cards or plan["cards_used"]) if ttft_ms is not None else 0.0
    best = _prefill_candidate(m, hw, pre.inst, wl, ttft_ms, pull, max_per_dp=pre.batch)
    pre_tok = best.tok_s_card if best else 0.0  # no batch within the TTFT SLO serves a request within it
    pre_req = pre_tok * pre.inst.cards / wl.input_len
    req_s = min(plan["decode_instances"] * dec_req, plan["prefill_instances"] * pre_req)
    return req_s * wl.output_len / plan["cards_used"]


def no_plan_reason(cards, tpot_ms, ttft_ms, dec_tally, pre_tally, decs, pres) -> str:
    """Why a search found no plan: which role had no usable layout, and what refused its layouts."""
    def counts(t: Counter, slo: str) -> str:
        words = {"memory": "do not fit in memory", "layout": "cannot run on this model",
                 slo: f"miss the {slo.upper()} SLO at batch 1",
                 "survive": "do not fit in memory after the --elastic-ep-losses"}
        return ", ".join(f"{t[k]} {w}" for k, w in words.items() if t[k]) or "none to try"
    if not decs:
        return (f"no decode layout on up to {cards} cards meets TPOT <= {tpot_ms:g} ms: of "
                f"{sum(dec_tally.values())} layouts, {counts(dec_tally, 'tpot')}")
    if not pres:
        slo = f" meets TTFT <= {ttft_ms:g} ms (with the KV pull)" if ttft_ms is not None else " fits"
        return (f"no prefill layout on up to {cards} cards{slo}: of {sum(pre_tally.values())} layouts, "
                f"{counts(pre_tally, 'ttft')}")
    d, p = min(c.inst.cards for c in decs), min(c.inst.cards for c in pres)
    return (f"no prefill + decode pair fits in {cards} cards: the smallest usable decode instance has {d} cards, "
            f"the smallest prefill instance {p}; give --cards >= {d + p}")


def _best_per_size(cands: list[Candidate]) -> list[Candidate]:
    """The best candidate of each instance size (cands sorted best first)."""
    best: dict[int, Candidate] = {}
    for c in cands:
        best.setdefault(c.inst.cards, c)
    return list(best.values())
