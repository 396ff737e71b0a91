"""Expert-load imbalance from recorded statistics (moeserve --expert-load-stats, or plain per-expert lists).

The factor is the max/mean EP-rank load each layer would have under the placement an EPLB deployment runs:
hot experts replicated into the layout's redundant slots and slots packed by load (layers/moe/eplb.py, the
same code `moeserve eplb` writes placements with); `balanced=False` keeps experts in contiguous blocks
(expert e on rank e * ranks // E). The mean over layers is returned: a step pays every layer's busiest
rank once. Statistics accumulated over many steps measure the routing's systematic skew; the planner adds
per-step sampling noise separately (comm.max_load_factor). Placing by the same statistics it is scored on
is optimistic for new traffic (EPLB re-plans periodically from recent loads).
"""
from __future__ import annotations

from moeserve.layers.moe.eplb import imbalance, rebalance
from moeserve.layers.moe.load_stats import read_loads


def rank_imbalance(loads: list[float], ranks: int) -> float:
    """max/mean of per-rank sums when experts are placed contiguously (expert e on rank e*ranks//E)."""
    n = len(loads)
    if n == 0 or ranks < 1 or sum(loads) <= 0:
        return 1.0
    per_rank = [0.0] * ranks
    for e, load in enumerate(loads):
        per_rank[e * ranks // n] += load
    return max(per_rank) / (sum(per_rank) / ranks)


def imbalance_from_file(paths: str | list[str], n_experts: int, ranks: int, redundant: int = 0,
                        balanced: bool = True) -> float:
    layers = read_loads([paths] if isinstance(paths, str) else list(paths), n_experts)
    factors = []
    for loads in layers.values():
        if sum(loads) <= 0:
            continue
        if balanced:
            factors.append(imbalance(rebalance(loads, redundant, ranks), loads, ranks))
        else:
            factors.append(rank_imbalance(loads, ranks))
    return max(1.0, sum(factors) / len(factors)) if factors else 1.0
