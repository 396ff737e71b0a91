"""Derived answers: decode throughput vs batch/TPOT, best throughput under a TPOT SLO, prefill TTFT.

Decode batch capacity uses the steady-state mean KV length (input + output/2): with paged KV a running
batch holds requests at every stage of their output (the simulator checks this against the scheduler).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from moeserve.perf import comm, moe
from moeserve.perf.deploy import DoesNotFit, Instance, PlanError, Workload
from moeserve.perf.hardware import Hardware
from moeserve.planner.memory import MemoryReport, memory_report, refusal_reason
from moeserve.perf.models import ModelSpec
from moeserve.perf.step import decode_step, prefill_step


def layout(m: ModelSpec, inst: Instance) -> dict:
    """An instance as JSON with its residual expert skew resolved (Instance.imbalance None: the model's
    published figure under EPLB, perf/moe.residual_skew), so `layout.imbalance` is always the factor used."""
    return {**asdict(inst), "imbalance": moe.residual_skew(m, inst)}


def band(fn, hw: Hardware) -> list[float] | None:
    """[low, high] of `fn(hardware)` with every efficiency factor at the low and at the high end of its
    documented range (data/hardware.yaml `ranges`); None when the hardware has no ranges. Every prediction
    is monotone in each factor (tests/planner/test_band.py), so the two ends bound the whole box."""
    if not hw.eff.ranges:
        return None
    return sorted(round(fn(hw.at(end)), 1) for end in ("low", "high"))


@dataclass
class DecodePoint:
    batch: int            # sequences per DP group
    step_ms: float
    tpot_ms: float
    tok_s_card: float     # output tokens/s per card
    breakdown_ms: dict
    hbm_util: float       # achieved HBM bandwidth / peak over the step

    def to_dict(self) -> dict:
        return {"batch_per_dp": self.batch, "step_ms": round(self.step_ms, 3),
                "tpot_ms": round(self.tpot_ms, 3), "tok_s_card": round(self.tok_s_card, 1),
                "hbm_util": round(self.hbm_util, 3),
                "breakdown_ms": {k: round(v, 3) for k, v in self.breakdown_ms.items()}}


def decode_point(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, batch: int) -> DecodePoint:
    st = decode_step(m, hw, inst, batch, wl.mean_decode_context)
    tps = inst.tokens_per_step
    br = {k: v * 1e3 for k, v in sorted(st.by_name().items(), key=lambda kv: -kv[1])}
    br["framework_overhead"] = st.overhead * 1e3
    if st.overlapped:
        br["overlap_saving"] = (st.total - st.overhead - sum(o.seconds for o in st.ops)) * 1e3
    return DecodePoint(batch, st.total * 1e3, st.total / tps * 1e3, batch * tps / (inst.tp * st.total),
                       br, st.hbm_bytes / st.total / hw.hbm_bw)


def decode_memory(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload) -> MemoryReport:
    """Memory at the largest batch that fits (activations sized for that batch).

    Activations grow with the batch, so the KV room for b sequences shrinks as b grows: the answer is the
    largest b whose report, with activations for b sequences, still holds b. (Iterating b -> room(b) from
    b = 1 oscillates when a sequence's activations outweigh its KV, as with short contexts: 16 in / 1 out
    on V2-Lite went 89428, 0, 89428, 0 and was refused.)"""
    step_tokens = 1 + inst.mtp_drafts

    def report(b: int) -> MemoryReport:
        return memory_report(m, hw, inst, wl.mean_decode_context, max(1, b) * step_tokens)

    rep = report(1)
    lo, hi = (1, rep.max_batch) if rep.max_batch >= 1 else (0, 0)  # room(b) <= room(1): b <= room(1)
    if inst.max_num_seqs is not None:  # the engine runs no more sequences per rank than it is allowed
        hi = min(hi, inst.max_num_seqs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if report(mid).max_batch >= mid:
            lo = mid
        else:
            hi = mid - 1
    return replace(report(lo), max_batch=lo) if lo else rep


def require_fits(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload) -> MemoryReport:
    rep = decode_memory(m, hw, inst, wl)
    reason = refusal_reason(m, hw, inst, rep)
    if reason:
        raise DoesNotFit(reason)
    return rep


def batch_grid(max_batch: int) -> list[int]:
    """1, 2, 4, ... plus intermediate points, up to max_batch."""
    pts, b = set(), 1.0
    while b <= max_batch:
        pts.add(int(b))
        b *= 1.25 if b >= 8 else 2
    pts.add(max_batch)
    return sorted(p for p in pts if p >= 1)


def decode_curve(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload,
                 max_batch: int | None = None) -> list[DecodePoint]:
    cap = require_fits(m, hw, inst, wl).max_batch
    return [decode_point(m, hw, inst, wl, b) for b in batch_grid(min(cap, max_batch or cap))]


def best_under_slo(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload,
                   tpot_ms: float) -> DecodePoint | None:
    """Largest batch whose TPOT meets the SLO (TPOT grows with batch, throughput too): bisection."""
    cap = require_fits(m, hw, inst, wl).max_batch
    if decode_point(m, hw, inst, wl, 1).tpot_ms > tpot_ms:
        return None
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_point(m, hw, inst, wl, mid).tpot_ms <= tpot_ms:
            lo = mid
        else:
            hi = mid - 1
    return decode_point(m, hw, inst, wl, lo)


def decode_at_batch(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, batch: int,
                    flag: str = "--batch-per-device") -> DecodePoint:
    """The decode point at a stated batch per device (what a published deployment gives instead of a TPOT
    target): every card of a DP group runs its `batch` sequences' attention, so it is the DP group's batch.
    A batch beyond the KV room (or --max-num-seqs) is refused naming `flag`."""
    cap = require_fits(m, hw, inst, wl).max_batch
    if batch > cap:
        limit = "--max-num-seqs" if inst.max_num_seqs is not None and cap == inst.max_num_seqs else "KV room"
        raise DoesNotFit(f"{flag} {batch} does not fit: {limit} allows {cap} sequences per device at mean context "
                         f"{wl.mean_decode_context:.0f}; use {flag} <= {cap}")
    return decode_point(m, hw, inst, wl, batch)


def requests_for_tokens(inst: Instance, tokens_per_device: int, length: int,
                        flag: str = "--tokens-per-device") -> int:
    """Prompts of `length` tokens in one prefill forward that carries `tokens_per_device` prompt tokens per
    card (the instance's prompt tokens / its cards): a whole number of prompts, else refused naming `flag`."""
    total = tokens_per_device * inst.cards
    if total % length:
        step = length // math.gcd(length, inst.cards)
        raise PlanError(f"{flag} {tokens_per_device} x {inst.cards} cards = {total} tokens is not a whole number "
                        f"of {length}-token prompts (--input-len); use a multiple of {step}")
    return total // length


@dataclass
class PrefillPoint:
    requests: int
    length: int
    ttft_ms: float        # one forward over all requests (no queueing)
    tok_s_card: float     # prompt tokens served per second and card, cached ones included
    breakdown_ms: dict
    cached: int = 0       # prompt tokens per request taken from the prefix cache

    @property
    def computed_tok_s_card(self) -> float:
        return self.tok_s_card * (self.length - self.cached) / self.length

    def to_dict(self) -> dict:
        return {"requests": self.requests, "input_len": self.length, "ttft_ms": round(self.ttft_ms, 3),
                "tok_s_card": round(self.tok_s_card, 1), "cached_tokens": self.cached,
                "computed_tok_s_card": round(self.computed_tok_s_card, 1),
                "breakdown_ms": {k: round(v, 3) for k, v in self.breakdown_ms.items()}}


def kv_pull_ms(m: ModelSpec, hw: Hardware, inst: Instance, length: int, deployment_cards: int) -> float:
    """Milliseconds for a PD decode instance to pull one `length`-token prompt's KV cache (main layers, and
    the MTP layer's when the deployment drafts) from the prefill instance. Over scale-up only when every
    card of the deployment sits in one scale-up domain; latent KV is replicated over attention TP, so a
    decode TP rank pulls one full copy in parallel with its peers."""
    nbytes = length * m.kv_bytes_per_token(inst.kv_bytes, with_mtp=inst.mtp_drafts > 0)
    return comm.kv_pull(hw, nbytes, in_domain=deployment_cards <= hw.scale_up_domain) * 1e3


def prefill_point(m: ModelSpec, hw: Hardware, inst: Instance, requests: int, length: int,
                  cached: int = 0) -> PrefillPoint:
    """`requests` prompts of `length` tokens spread over the DP groups; the busiest group sets the pace.
    `cached`: tokens of each prompt already in the prefix cache (Workload.cached_prompt_tokens): they hold
    KV and are attended to, but only the other `length - cached` are computed."""
    per_dp = math.ceil(requests / inst.dp)
    new = length - cached
    # Prefill samples one position per prompt (plus its MTP draft): logits for those rows only.
    rows = per_dp * (1 + (1 if inst.mtp_drafts else 0))
    rep = memory_report(m, hw, inst, length, per_dp * new, logit_rows=rows, total_tokens=requests * new)
    if rep.max_batch < per_dp:
        reason = refusal_reason(m, hw, inst, rep) or (
            f"{per_dp} prompts of {length} tokens per DP group need KV for {per_dp} sequences, room for "
            f"{rep.max_batch}; use more prefill cards or fewer requests per batch")
        raise DoesNotFit(reason)
    st = prefill_step(m, hw, inst, per_dp, new, past=cached, n_tokens=requests * new)
    br = {k: v * 1e3 for k, v in sorted(st.by_name().items(), key=lambda kv: -kv[1])}
    br["framework_overhead"] = st.overhead * 1e3
    return PrefillPoint(requests, length, st.total * 1e3, requests * length / st.total / inst.cards, br, cached)
