"""Collective costs on a two-level network: a scale-up domain (NVLink, HCCS, UB) and scale-out NICs.

Time of one collective = latency floor + max(bytes over scale-up / achieved scale-up bandwidth, bytes over
scale-out / achieved scale-out bandwidth), the two link classes running in parallel. Achieved bandwidths
are nominal x `link` / `link_out` (data/hardware.yaml, each from a measured figure). The floor of an
expert-parallel dispatch or combine comes from a measured table (DeepEP low-latency on H800, CANN on the
CloudMatrix UB, kernels.md; TensorRT-LLM NVLinkOneSided on GB200 NVL72; MORI-EP on MI300X): the measured time at the table's EP size minus its own payload at the
measuring system's links, never decreasing with EP (floor_us). Plain collectives (allgather,
reduce-scatter, allreduce, KV pulls) pay a per-hop latency from the link figures instead. The kernel
profile drops every floor and hop latency (term `collective_floor`).
"""
from __future__ import annotations

import math

from moeserve.perf.hardware import CollectiveTable, Hardware

KINDS = ("dispatch", "combine")


def _bw(hw: Hardware) -> tuple[float, float]:
    """Achieved (scale-up, scale-out) bytes/s per card, one direction."""
    return (hw.scale_up_gbps * 1e9 * hw.eff.link_up, hw.scale_out_gbps * 1e9 * hw.eff.link_scale_out)


def payload_time(hw: Hardware, bytes_up: float, bytes_out: float) -> float:
    """Seconds to move bytes_up over scale-up and bytes_out over scale-out, in parallel (no latency)."""
    up, out = _bw(hw)
    return max(bytes_up / up if bytes_up else 0.0, bytes_out / out if bytes_out else 0.0)


def hop_latency(hw: Hardware, up_hops: float, out_hops: float) -> float:
    """Seconds of per-hop latency (kernels.md link latencies), or 0 without the collective_floor term."""
    if not hw.eff.has("collective_floor"):
        return 0.0
    return (up_hops * hw.eff.link_latency_us + out_hops * hw.eff.latency_out_us) * 1e-6


def link_time(hw: Hardware, bytes_up: float, bytes_out: float, n_ops: int = 1) -> float:
    """Payload plus `n_ops` hops on the slower link class used (scale-out if any bytes leave the domain)."""
    out_hops = n_ops if bytes_out else 0
    return payload_time(hw, bytes_up, bytes_out) + hop_latency(hw, 0 if out_hops else n_ops, out_hops)


def domain_fractions(hw: Hardware, ranks: int, domain: int | None = None) -> tuple[float, float]:
    """(in-domain, out-of-domain) fraction of uniformly spread destinations, excluding self."""
    domain = min(hw.scale_up_domain if domain is None else domain, ranks)
    return (domain - 1) / ranks, 1.0 - domain / ranks


def table_floors(t: CollectiveTable) -> list[tuple[int, float, float]]:
    """(EP, dispatch floor us, combine floor us): each measured time minus its payload on the measuring
    links, then a running maximum so a larger EP never has a lower floor than a smaller one."""
    out, best_d, best_c = [], 0.0, 0.0
    copies = t.tokens * t.topk
    for ep, d_us, c_us in t.points:
        dom = min(t.domain, ep)
        f_up, f_out = (dom - 1) / ep, 1.0 - dom / ep
        pay = []
        for per_elem in (t.dispatch_bytes, t.combine_bytes):
            vol = copies * t.hidden * per_elem
            pay.append(max(vol * f_up / (t.up_gbps * 1e3), vol * f_out / (t.out_gbps * 1e3)))  # us
        best_d = max(best_d, d_us - pay[0])
        best_c = max(best_c, c_us - pay[1])
        out.append((ep, best_d, best_c))
    return out


def floor_us(hw: Hardware, ranks: int, kind: str) -> float | None:
    """Latency floor of one dispatch or combine over `ranks` EP ranks from the hardware's measured table
    (None without one). Beyond the table's largest EP the largest EP's floor holds; below its smallest,
    the smallest's (a smaller group is not measured)."""
    t = hw.collective
    if t is None or ranks <= 1:
        return None
    floors = table_floors(t)
    i = KINDS.index(kind) + 1
    chosen = floors[0][i]
    for row in floors:
        if row[0] <= ranks:
            chosen = row[i]
    return chosen


def alltoall(hw: Hardware, ranks: int, copies: float, bytes_per_copy: float, kind: str = "dispatch") -> float:
    """Dispatch or combine: `copies` token copies leave (or reach) the busiest card, spread uniformly.
    Floor from the measured table when the hardware has one, else one hop on the links used."""
    if ranks <= 1 or copies <= 0:
        return 0.0
    f_up, f_out = domain_fractions(hw, ranks)
    vol = copies * bytes_per_copy
    pay = payload_time(hw, vol * f_up, vol * f_out)
    floor = floor_us(hw, ranks, kind) if hw.eff.has("collective_floor") else None
    if floor is None:
        return pay + hop_latency(hw, 0 if f_out else 1, 1 if f_out else 0)
    return pay + floor * 1e-6


def normal_rate(hw: Hardware, ranks: int, kind: str) -> float | None:
    """Bytes/s of DeepEP's normal-mode RDMA path per card at this EP size (None: the fabric has no
    normal-mode figure): the measured rate at the largest measured EP <= ranks (the smallest below it),
    scaled by this card's NIC against the measuring one."""
    t = hw.collective
    if t is None or not t.normal_rdma:
        return None
    i = KINDS.index(kind) + 1
    chosen = t.normal_rdma[0][i]
    for row in t.normal_rdma:
        if row[0] <= ranks:
            chosen = row[i]
    return chosen * 1e9 * hw.scale_out_gbps / t.normal_nic_gbps


def normal_alltoall(hw: Hardware, ranks: int, send_rows: float, nodes_per_row: float, recv_rows: float,
                    bytes_per_row: float, kind: str = "dispatch") -> float | None:
    """DeepEP normal mode (prefill) dispatch or combine (None: no normal-mode figure for this fabric).

    Each of the card's `send_rows` tokens crosses the network once per destination node (`nodes_per_row`,
    own node included, as DeepEP counts its RDMA bytes) at the measured normal-mode RDMA rate, and each card
    receives its `recv_rows` distinct tokens over scale-up (NVLink forwarding; one copy per card however many
    of its experts a token picks), the two pipelined. Inside one scale-up domain only the NVLink part runs
    (kernels.md: EP8 intranode 153 / 158 GB/s, the achieved scale-up rate). One hop of each link class used.
    """
    rate = normal_rate(hw, ranks, kind)
    if rate is None or ranks <= 1:
        return None
    up, _ = _bw(hw)
    nvl = recv_rows * bytes_per_row / up
    if ranks <= hw.scale_up_domain:
        return nvl + hop_latency(hw, 1, 0)
    rdma = send_rows * nodes_per_row * bytes_per_row / rate
    return max(rdma, nvl) + hop_latency(hw, 1, 1)


def moe_gather(hw: Hardware, ranks: int, total_bytes: float, kind: str) -> float:
    """The allgather (dispatch) or reduce-scatter (combine) of an allgather-mode MoE layer: the bytes of a
    hierarchical allgather, and the fabric's measured dispatch / combine floor at this EP size in place of
    the plain hop latencies when the hardware has a table (the same CANN / DeepEP operation role: quantise,
    route, synchronise the EP group)."""
    floor = floor_us(hw, ranks, kind) if hw.eff.has("collective_floor") else None
    if floor is None or ranks <= 1 or total_bytes <= 0:
        return allgather(hw, ranks, total_bytes)
    return _hier_payload(hw, ranks, total_bytes) + floor * 1e-6


def hier_gather_bytes(ranks: int, domain: int, total_bytes: float) -> tuple[float, float]:
    """(in-domain, out-of-domain) bytes one card sends in a hierarchical allgather of `total_bytes` (each card
    contributes 1/ranks) over domains of `domain` cards: out of the domain once per other domain, then shared
    inside it. The engine's --moe-comm-hierarchy two-stage schedule moves exactly these (its byte counters
    moe_intra_node / moe_inter_node; tests/distributed/test_two_stage_collectives.py checks them against this),
    and so does its reduce-scatter, the mirror."""
    s = min(domain, ranks)
    return total_bytes * (s - 1) / s, total_bytes * (ranks - s) / (ranks * s)


def _hier_payload(hw: Hardware, ranks: int, total_bytes: float) -> float:
    """Payload seconds of a hierarchical allgather: the scale-out phase (each card fetches 1/S of the
    outside data over its NIC) feeds the scale-up phase (the domain shares it), so the two are sequential,
    except that with R = nodes - 1 rounds (one per other node, round-pipelined as in Omni-Infer's A2
    decode) the shorter phase hides behind the longer one but for one round: max + min / R."""
    s = min(hw.scale_up_domain, ranks)
    up, out = _bw(hw)
    in_domain, out_domain = hier_gather_bytes(ranks, s, total_bytes)
    t_up = in_domain / up
    t_out = out_domain / out
    rounds = max(1, math.ceil(ranks / s) - 1)
    return max(t_up, t_out) + min(t_up, t_out) / rounds


def allgather(hw: Hardware, ranks: int, total_bytes: float) -> float:
    """Every card ends with all `total_bytes` (each card contributes 1/ranks).

    Hierarchical when the group spans domains (system-brief item 9): each card of a domain fetches 1/S of
    the outside data over its own NIC, then the domain shares it over scale-up. Per card: in-domain
    total*(S-1)/S, out-of-domain total*(ranks-S)/(ranks*S) (phases: _hier_payload). Ring steps: S-1 hops
    inside, nodes-1 outside.
    """
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    s = min(hw.scale_up_domain, ranks)
    nodes = math.ceil(ranks / s)
    return _hier_payload(hw, ranks, total_bytes) + hop_latency(hw, s - 1, nodes - 1)


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
    (CloudMatrix's unified bus), else over the scale-out NIC. One message, so one hop."""
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
