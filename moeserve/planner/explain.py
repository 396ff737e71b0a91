"""What `plan validate` shows beside each prediction: the gap from kernels to the end-to-end figure term by
term, a prefill row with its PD hand-off, published per-layer times, and the leave-one-out check.

Nothing here feeds a prediction: each is the same model run with terms switched off, with another
boundary, or with the other cases removed or their published values changed.
"""
from __future__ import annotations

from dataclasses import replace

from moeserve.planner.analysis import decode_point, kv_pull_ms, prefill_point
from moeserve.perf.deploy import Instance, Workload, fewest_redundant_slots
from moeserve.perf.hardware import TERMS, Hardware
from moeserve.planner.layers import layer_breakdown
from moeserve.perf.models import load_model


def with_terms(hw: Hardware, terms) -> Hardware:
    return replace(hw, eff=replace(hw.eff, terms=tuple(terms)))


def term_steps(value, hw: Hardware) -> list[dict]:
    """`value(hw)` with no term (kernel-only), then adding each term of hw in TERMS order: each step's value
    and its change, so the kernel-only vs end-to-end gap is explained term by term."""
    on = [t for t in TERMS if hw.eff.has(t)]
    prev = value(with_terms(hw, ()))
    out = [{"term": "kernels", "value": round(prev, 1)}]
    for i, t in enumerate(on):
        v = value(with_terms(hw, on[: i + 1]))
        out.append({"term": t, "value": round(v, 1), "change_pct": round(100 * (v - prev) / prev, 1) if prev else None})
        prev = v
    return out


# Operator names (perf/cost.py, moe.py, step.py) by the term of the step they belong to; MTP passes count
# with the main model's ops of the same kind ("mtp_" prefix dropped).
TERM_OF = {
    "mla_decode": "attention", "attn_prefill": "attention",
    "attn_proj": "projections",
    "dense_mlp": "dense_gemm", "lm_head": "dense_gemm", "router": "dense_gemm", "eh_proj": "dense_gemm",
    "routed_experts": "moe_gemm", "shared_experts": "moe_gemm",
    "elementwise": "elementwise", "moe_permute": "elementwise",
    "dispatch": "dispatch_combine", "combine": "dispatch_combine", "allgather": "dispatch_combine",
    "reduce_scatter": "dispatch_combine",
    "tp_allreduce": "tp_collectives", "tp_reduce_scatter": "tp_collectives", "tp_allgather": "tp_collectives",
    "tp_alltoall": "tp_collectives",
    "comm_overlap": "overlap", "weight_prefetch": "overlap", "overlap_saving": "overlap",
    "framework_overhead": "framework",
}
SHARE_TERMS = ("attention", "projections", "dense_gemm", "moe_gemm", "elementwise", "dispatch_combine",
               "tp_collectives", "overlap", "framework")


def step_shares(breakdown_ms: dict, total_ms: float) -> dict:
    """Percent of the step each term takes (overlap negative: the time it hides), summing to 100. What the
    breakdown leaves out of the total (two-batch overlap's saving in a prefill point) counts as overlap."""
    ms = dict.fromkeys(SHARE_TERMS, 0.0)
    for name, v in breakdown_ms.items():
        term = TERM_OF.get(name.removeprefix("mtp_"), "other")
        ms[term] = ms.get(term, 0.0) + v
    ms["overlap"] += total_ms - sum(breakdown_ms.values())
    return {k: round(100 * v / total_ms, 1) for k, v in ms.items() if abs(v) > 1e-9 and total_ms}


def instance_of(m, kw: dict) -> Instance:
    kw = dict(kw)
    if "redundant_experts" not in kw:  # as on the command line
        kw["redundant_experts"] = fewest_redundant_slots(m.n_routed_experts,
                                                         kw["cards"] - kw.get("shared_expert_ranks", 0))
    return Instance(**kw)


def handoff(case: dict, hw: Hardware) -> dict | None:
    """A prefill case at both boundaries: the forward alone, and with the PD hand-off (the decode instance
    pulls one prompt's KV, all ranks in parallel, then runs its first step at batch 1)."""
    h = case.get("handoff")
    if not h:
        return None
    m = load_model(case.get("model", "deepseek-v3"))
    pre, dec = instance_of(m, case["instance"]), instance_of(m, h["instance"])
    fwd = prefill_point(m, hw, pre, case["requests"], case["input_len"]).ttft_ms
    pull = kv_pull_ms(m, hw, dec, case["input_len"], h["deployment_cards"])
    first = decode_point(m, hw, dec, Workload(case["input_len"], 1), 1).step_ms
    total = fwd + pull + first
    tok = case["requests"] * case["input_len"] / (pre.cards * total * 1e-3)
    return {"forward_ms": round(fwd, 1), "kv_pull_ms": round(pull, 2), "first_decode_step_ms": round(first, 2),
            "with_handoff_ms": round(total, 1), "with_handoff_tok_s_card": round(tok, 1),
            "taken_as": "forward alone (the prefill instance's TTFT)"}


def per_layer(table: dict, db) -> list[dict]:
    """Each published per-layer time against the model's, on its case's hardware and layout."""
    named = {c["id"]: c for c in table["cases"] + table["unlisted"]}
    rows = []
    for chk in table.get("per_layer") or []:
        case = named[chk["case"]]
        m = load_model(case.get("model", "deepseek-v3"))
        inst = replace(instance_of(m, case["instance"]), mtp_drafts=chk["mtp_drafts"])
        hw = db.get(case["hardware"])
        res = layer_breakdown(m, hw, inst, chk["batch"], chk["context"])
        pub = float(chk["published_us"])
        rows.append({"id": chk["id"], "published_us": pub, "per_layer_us": res["per_layer_us"],
                     "error_pct": round(100 * (res["per_layer_us"] - pub) / pub, 1),
                     "moe_layer_us": res["moe_layer_total_us"],
                     "moe_layer_error_pct": round(100 * (res["moe_layer_total_us"] - pub) / pub, 1),
                     "breakdown": res})
    return rows


def leave_one_out(table: dict, predict_value) -> list[dict]:
    """Each case predicted (a) with the whole table, (b) alone, (c) with every other case's published value
    doubled and halved. Nothing is fitted to the rows, so all agree to the last digit; `changed_pct` is the
    largest difference (0 unless something reads the published values)."""
    cases = table["cases"]
    out = []
    for i, case in enumerate(cases):
        full = predict_value(case, cases)
        alone = predict_value(case, [case])
        others = []
        for f in (2.0, 0.5):
            moved = [c if j == i else {**c, "published": {**c["published"], "value": c["published"]["value"] * f}}
                     for j, c in enumerate(cases)]
            others.append(predict_value(case, moved))
        changed = max(abs(v - full) for v in [alone] + others) / full * 100 if full else 0.0
        pub = float(case["published"]["value"])
        out.append({"id": case["id"], "predicted": round(full, 1), "alone": round(alone, 1),
                    "others_doubled": round(others[0], 1), "others_halved": round(others[1], 1),
                    "changed_pct": round(changed, 6), "error_pct": round(100 * (alone - pub) / pub, 1)})
    return out
