"""`moeserve plan validate`: predicted vs published for the cases in data/published.yaml (or a user's
own file of cases, planner/cases.py).

The cases only choose layouts; every efficiency factor is the shared one from hardware.yaml. `predicted`
uses the default (end_to_end) profile, which pays every operator-level term; each row also carries
`predicted_kernel` (kernels alone), `terms` (the gap between the two, term by term; explain.py), a
prefill case's `handoff`, and `band`, the prediction with every factor at the low and at the high end of
its documented range. `per_layer` holds published per-layer times against the model's. `unlisted` holds sanity checks against other
published deployments (DeepSeek's own H800 figures); they are reported, not part of `all_within`.
`feasibility` asks whether any single set of factors inside the documented ranges would put every case
within the tolerance: an analysis of the facts, never used for a prediction.
"""
from __future__ import annotations

import itertools
import math
from contextlib import contextmanager

from moeserve.planner import cases as case_files
from moeserve.planner import explain
from moeserve.planner.analysis import band, best_under_slo, decode_at_batch, decode_point, prefill_point
from moeserve.perf.deploy import Instance, PlanError, Workload, fewest_redundant_slots
from moeserve.perf.hardware import HardwareDB
from moeserve.perf.models import check_context, load_model


def load_cases(path: str | None = None) -> dict:
    """The built-in published results, or a user's file of cases (checked either way)."""
    return case_files.read(path) if path else case_files.builtin()


def _value(case: dict, hw) -> tuple[float, dict]:
    """(the case's published metric as predicted on `hw`, the point's details)."""
    m = load_model(case.get("model", "deepseek-v3"))
    kw = dict(case["instance"])
    if "redundant_experts" not in kw:  # as on the command line
        kw["redundant_experts"] = fewest_redundant_slots(m.n_routed_experts,
                                                         kw["cards"] - kw.get("shared_expert_ranks", 0))
    inst = Instance(**kw)
    if case["kind"] == "decode":
        wl = Workload(**case["workload"])
        if "batch_per_device" in case:  # the stated operating point, no SLO search
            pt = decode_at_batch(m, hw, inst, wl, case["batch_per_device"], "batch_per_device")
            return pt.tok_s_card, pt.to_dict()
        pt = best_under_slo(m, hw, inst, wl, case["tpot_ms"])
        if pt is None:  # counts as 0 tok/s/card; the row says why (a bare -100% read as a broken model)
            return 0.0, {"note": f"no batch meets tpot_ms {case['tpot_ms']:g}: TPOT at batch 1 is "
                                 f"{decode_point(m, hw, inst, wl, 1).tpot_ms:.1f} ms"}
        return pt.tok_s_card, pt.to_dict()
    pt = prefill_point(m, hw, inst, case["requests"], case["input_len"])
    return getattr(pt, case["published"]["metric"]), pt.to_dict()


@contextmanager
def _about(case: dict):
    """Errors (unknown hardware or model, a layout the model cannot run, one that does not fit) name the case;
    PlanError / DoesNotFit keep their class (exit codes)."""
    try:
        yield
    except ValueError as err:
        cls = type(err) if isinstance(err, PlanError) else ValueError
        hint = "; --hardware-file adds devices and systems" if str(err).startswith("unknown hardware") else ""
        raise cls(f"case {case['id']!r}: {case_files.as_fields(str(err))}{hint}") from None


def _case_hardware(case: dict, db: HardwareDB):
    """The case's hardware, after checking its lengths against its model's context window (as `plan
    decode/prefill` do: a 200K-token decode case on deepseek-v3 priced a row instead of being refused)."""
    m = load_model(case.get("model", "deepseek-v3"))
    if case["kind"] == "prefill":
        check_context(m, case["input_len"], None, ("input_len",))
    else:
        wl = Workload(**case["workload"])
        check_context(m, wl.input_len, wl.output_len, ("workload input_len", "output_len"))
    return db.get(case["hardware"])


def predict(case: dict, db: HardwareDB) -> dict:
    with _about(case):
        hw = _case_hardware(case, db)
        value, detail = _value(case, hw)
        return {"value": value, "detail": detail, "band": band(lambda h: _value(case, h)[0], hw)}


def _pct(value: float, published: float) -> float:
    return 100 * (value - published) / published


def _rows(cases: list, db: HardwareDB, kernel_db: HardwareDB, tol: float) -> list[dict]:
    rows = []
    for case in cases:
        pred = predict(case, db)
        with _about(case):
            hw = _case_hardware(case, db)
            terms = explain.term_steps(lambda h: _value(case, h)[0], hw)
            handoff = explain.handoff(case, hw)
        pub = float(case["published"]["value"])
        err = (pred["value"] - pub) / pub
        kern = predict(case, kernel_db)["value"]
        rng, detail = pred["band"], dict(pred["detail"])
        total = detail.get("step_ms", detail.get("ttft_ms"))
        shares = explain.step_shares(detail["breakdown_ms"], total) if total else {}
        rows.append({"id": case["id"], "what": case["what"], "unit": case["published"]["metric"],
                     "published": pub, "predicted": round(pred["value"], 1),
                     "error_pct": round(100 * err, 1), "within_tolerance": abs(err) <= tol,
                     "band": rng, "band_error_pct": rng and [round(_pct(v, pub), 1) for v in rng],
                     "published_in_band": rng is not None and rng[0] <= pub <= rng[1],
                     "predicted_kernel": round(kern, 1),
                     "error_kernel_pct": round(100 * (kern - pub) / pub, 1),
                     "note": detail.pop("note", None), "terms": terms, "handoff": handoff,
                     "step_shares_pct": shares, "detail": detail})
    return rows


def validate(hardware_file: str | None = None, profile: str | None = None, cases_file: str | None = None) -> dict:
    """One JSON-able object: rows with `published` and `predicted` in the same unit."""
    table = load_cases(cases_file)
    db = HardwareDB(hardware_file, profile)
    kernel_db = HardwareDB(hardware_file, "kernel")
    tol = float(table["tolerance"])
    rows = _rows(table["cases"], db, kernel_db, tol)
    unlisted = _rows(table.get("unlisted") or [], db, kernel_db, tol)
    return {"tolerance_pct": 100 * tol, "efficiency_profile": db.profile,
            "serving_factor": db.get(table["cases"][0]["hardware"]).eff.serving,
            "terms": list(db.get(table["cases"][0]["hardware"]).eff.terms),
            "all_within": all(r["within_tolerance"] for r in rows), "rows": rows,
            "unlisted": unlisted, "per_layer": explain.per_layer(table, db)}


def leave_one_out(hardware_file: str | None = None, profile: str | None = None,
                  cases_file: str | None = None) -> dict:
    """Every case predicted with the whole table, alone, and with the other cases' published values doubled
    and halved, each table read and checked as a cases file is (explain.leave_one_out)."""
    table = load_cases(cases_file)
    db = HardwareDB(hardware_file, profile)

    def value(case: dict, cases: list) -> float:
        checked = case_files.check({"tolerance": table["tolerance"], "cases": cases}, "leave-one-out table")
        mine = next(c for c in checked["cases"] if c["id"] == case["id"])
        with _about(mine):
            return _value(mine, _case_hardware(mine, db))[0]

    rows = explain.leave_one_out(table, value)
    return {"efficiency_profile": db.profile, "rows": rows,
            "max_changed_pct": max(r["changed_pct"] for r in rows) if rows else 0.0}


def format_leave_one_out(res: dict) -> str:
    lines = [f"leave-one-out ({res['efficiency_profile']}): each case alone and with the others' published "
             "values doubled / halved",
             f"{'case':<24} {'with all':>10} {'alone':>10} {'others x2':>10} {'others /2':>10} {'error':>8}"]
    lines += [f"{r['id']:<24} {r['predicted']:>10.1f} {r['alone']:>10.1f} {r['others_doubled']:>10.1f} "
              f"{r['others_halved']:>10.1f} {r['error_pct']:>+7.1f}%" for r in res["rows"]]
    lines.append(f"largest change: {res['max_changed_pct']:g}% (nothing is fitted to the rows)")
    return "\n".join(lines)


def _grid(hw_list, points: int) -> dict[str, list[float]]:
    """Per ranged factor: `points` evenly spaced values over its range, plus the point value in use."""
    grid: dict[str, set] = {}
    for hw in hw_list:
        for k, lo, hi in hw.eff.ranges:
            # Clamped: rounding may leave the range (a low end of 1e-6 rounded to 0, refused as a factor).
            vals = {min(hi, max(lo, round(lo + (hi - lo) * i / (points - 1), 4)))
                    for i in range(points)} if points > 1 else set()
            grid.setdefault(k, set()).update(vals | {getattr(hw.eff, k)})
    return {k: sorted(v) for k, v in sorted(grid.items())}


def feasibility(hardware_file: str | None = None, profile: str | None = None, points: int = 3,
                cases: list | None = None, cases_file: str | None = None) -> dict:
    """The smallest worst-case |error| over the calibration cases that one set of efficiency factors,
    each inside its documented range, reaches on a grid (`points` values per factor, plus the value in
    use, so the answer is never worse than the planner's own). Only the cases count, not `unlisted`;
    `cases` replaces them (benchmarks/plan_validate.py varies the layouts the brief leaves open)."""
    table = load_cases(cases_file)
    db = HardwareDB(hardware_file, profile)
    cases = table["cases"] if cases is None else cases
    hws = {}
    for c in cases:
        with _about(c):
            hws[c["hardware"]] = _case_hardware(c, db)
    ranged = {key: {r[0] for r in hw.eff.ranges} for key, hw in hws.items()}
    grid = _grid(hws.values(), points)
    best = None
    for combo in itertools.product(*grid.values()):
        factors = dict(zip(grid, combo))
        errs = {}
        for case in cases:
            hw = hws[case["hardware"]]
            mine = {k: v for k, v in factors.items() if k in ranged[case["hardware"]]}
            with _about(case):
                value = _value(case, hw.with_overrides(**mine))[0]
            errs[case["id"]] = _pct(value, float(case["published"]["value"]))
        worst = max(abs(e) for e in errs.values())
        if best is None or worst < best[0]:
            best = (worst, factors, errs)
    tol = 100 * float(table["tolerance"])
    worst, factors, errs = best
    return {"tolerance_pct": tol, "efficiency_profile": db.profile, "points_per_factor": points,
            "combinations": math.prod(len(v) for v in grid.values()), "grid": grid,
            "best_max_abs_error_pct": round(worst, 1), "best_factors": factors,
            "best_errors_pct": {k: round(v, 1) for k, v in errs.items()}, "reachable": worst <= tol}


def format_feasibility(res: dict) -> str:
    f = (", ".join(f"{k} {v:g}" for k, v in res["best_factors"].items())
         or "the values in use (no factor has a range)")
    errs = ", ".join(f"{k} {v:+.1f}%" for k, v in res["best_errors_pct"].items())
    verdict = "reachable" if res["reachable"] else "not reachable on this grid"
    return (f"feasibility ({res['efficiency_profile']}, {res['combinations']} factor sets inside the documented "
            f"ranges, {res['points_per_factor']} values per factor + the value in use):\n"
            f"  best worst-case error {res['best_max_abs_error_pct']:.1f}% at {f}\n  rows there: {errs}\n"
            f"  tolerance +-{res['tolerance_pct']:g}%: {verdict} (an analysis only: predictions always use "
            "the point values)")


def format_table(result: dict) -> str:
    w = max([24] + [len(r["id"]) for r in result["rows"] + (result.get("unlisted") or [])])  # a user's long ids
    head = (f"{'case':<{w}} {'unit':<11} {'published':>10} {'predicted':>10} {'error':>8}  ok   "
            f"{'band (documented ranges)':>26} {'kernel-only':>11} {'error':>8}")

    def line(r, ok):
        rng = (f"{r['band'][0]:.0f}..{r['band'][1]:.0f} ({r['band_error_pct'][0]:+.0f}..{r['band_error_pct'][1]:+.0f}%)"
               if r["band"] else "-")
        return (f"{r['id']:<{w}} {r['unit']:<11} {r['published']:>10.1f} {r['predicted']:>10.1f} "
                f"{r['error_pct']:>+7.1f}%  {ok:<4} {rng:>26} {r['predicted_kernel']:>11.1f} "
                f"{r['error_kernel_pct']:>+7.1f}%" + (f"  ({r['note']})" if r.get("note") else ""))
    terms = ", ".join(result.get("terms") or []) or "none"
    lines = [f"efficiency profile: {result['efficiency_profile']} (terms: {terms})",
             head]
    lines += [line(r, "yes" if r["within_tolerance"] else "NO") for r in result["rows"]]
    lines.append(f"tolerance +-{result['tolerance_pct']:g}%; all within: {result['all_within']}; published "
                 f"inside the band: {sum(r['published_in_band'] for r in result['rows'])} of {len(result['rows'])}")
    if result.get("unlisted"):
        lines.append("unlisted sanity checks (reference figures are approximate, not part of the tolerance):")
        lines += [line(r, "-") for r in result["unlisted"]]
    lines.append("kernel-only -> end-to-end, term by term (each term's change of the row's metric):")
    for r in result["rows"] + (result.get("unlisted") or []):
        if r.get("terms"):
            steps = "  ".join(f"{t['term']} {t['change_pct']:+.1f}%" for t in r["terms"][1:] if t["change_pct"])
            lines.append(f"  {r['id']:<{w}} kernels {r['terms'][0]['value']:.1f} -> {r['terms'][-1]['value']:.1f}: "
                         f"{steps or 'no term changes it'}")
    lines.append("share of the step by term (% of the step at the predicted point; overlap: time hidden):")
    for r in result["rows"] + (result.get("unlisted") or []):
        if r.get("step_shares_pct"):
            lines.append(f"  {r['id']:<{w}} " + "  ".join(f"{k} {v:.1f}" for k, v in r["step_shares_pct"].items()))
    for r in result["rows"]:
        h = r.get("handoff")
        if h:
            lines.append(f"  {r['id']}: taken as the {h['taken_as']}: {h['forward_ms']:.1f} ms; with the hand-off "
                         f"(KV pull {h['kv_pull_ms']:.2f} ms + first decode step {h['first_decode_step_ms']:.2f} ms) "
                         f"{h['with_handoff_ms']:.1f} ms = {h['with_handoff_tok_s_card']:.1f} tok/s/card")
    if result.get("per_layer"):
        lines.append("per-layer decode time (published vs the model's step / layers, and its MoE layer alone):")
        lines += [f"  {p['id']:<{w}} published {p['published_us']:.0f} us, model {p['per_layer_us']:.0f} us "
                  f"({p['error_pct']:+.1f}%), MoE layer {p['moe_layer_us']:.0f} us ({p['moe_layer_error_pct']:+.1f}%)"
                  for p in result["per_layer"]]
    return "\n".join(lines)
