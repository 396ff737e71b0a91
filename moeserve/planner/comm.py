"""Collective costs on a two-level network: a scale-up domain (NVLink, HCCS, UB) and scale-out NICs.

Time of one collective = max(bytes over scale-up / (bw_up * eff), bytes over scale-out / (bw_out * eff))
+ latency, the two link classes running in parallel. The form and both constants (~80% of link, ~20 us)
reproduce DeepEP's measured dispatch/combine times at EP 8..128 (hardware.md; tests/planner/test_comm.py).
"""
from __future__ import annotations

import math

from moeserve.planner.hardware import Hardware


def link_time(hw: Hardware, bytes_up: float, bytes_out: float, n_ops: int = 1) -> float:
    """Seconds to move bytes_up over scale-up and bytes_out over scale-out (per card, one direction)."""
    eff = hw.eff.link
    t_up = bytes_up / (hw.scale_up_gbps * 1e9 * eff) if bytes_up else 0.0
    t_out = bytes_out / (hw.scale_out_gbps * 1e9 * eff) if bytes_out else 0.0
    return max(t_up, t_out) + n_ops * hw.eff.link_latency_us * 1e-6


def domain_fractions(hw: Hardware, ranks: int) -> tuple[float, float]:
    """(in-domain, out-of-domain) fraction of uniformly spread destinations, excluding self."""
    domain = min(hw.scale_up_domain, ranks)
    return (domain - 1) / ranks, 1.0 - domain / ranks


def alltoall(hw: Hardware, ranks: int, copies: float, bytes_per_copy: float) -> float:
    """Dispatch or combine: `copies` token copies leave (or reach) the busiest card, spread uniformly."""
    if ranks <= 1 or copies <= 0:
        return 0.0
    f_up, f_out = domain_fractions(hw, ranks)
    vol = copies * bytes_per_copy
    return link_time(hw, vol * f_up, vol * f_out)


def allgather(hw: Hardware, ranks: int, total_bytes: float) -> float:
    """Every card ends with all `total_bytes` (each card contributes 1/ranks).

    Hierarchical when the group spans domains (system-brief item 9): each card of a domain fetches 1/S of
    the outside data over its own NIC, then the domain shares it over scale-up. Per card: in-domain
    total*(S-1)/S, out-of-domain total*(ranks-S)/(ranks*S).
    """
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    s = min(hw.scale_up_domain, ranks)
    up = total_bytes * (s - 1) / s
    out = total_bytes * (ranks - s) / (ranks * s)
    return link_time(hw, up, out, n_ops=1 if s == ranks else 2)


def reduce_scatter(hw: Hardware, ranks: int, total_bytes: float) -> float:
    """The mirror of allgather: same bytes on the same links."""
    return allgather(hw, ranks, total_bytes)


def allreduce(hw: Hardware, ranks: int, nbytes: float) -> float:
    """Ring allreduce = reduce-scatter + allgather of nbytes per card."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * allgather(hw, ranks, nbytes)


def kv_pull(hw: Hardware, nbytes: float, in_domain: bool) -> float:
    """A decode rank pulls one request's prompt KV from the prefill card that holds it (system-brief item 1:
    "decode pulls it"): one point-to-point read over scale-up when both instances share a scale-up domain
    (CloudMatrix's unified bus), else over the scale-out NIC. One message, so one latency."""
    if nbytes <= 0:
        return 0.0
    if in_domain:
        return link_time(hw, nbytes, 0.0)
    return link_time(hw, 0.0, nbytes)


def max_load_factor(mean: float, ranks: int) -> float:
    """Expected max/mean of per-rank loads when `mean` token copies per rank are drawn at random.

    Gaussian approximation of the Poisson maximum over `ranks` draws: mean + sqrt(2 ln R) sqrt(mean).
    This is sampling noise with perfectly balanced expert popularity (what EPLB aims for); residual
    popularity skew is the separate Instance.imbalance factor.
    """
    if mean <= 0 or ranks <= 1:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(ranks) / mean)
