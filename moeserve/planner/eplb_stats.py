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

from dataclasses import replace

from moeserve.layers.moe.eplb import imbalance, rebalance
from moeserve.layers.moe.load_stats import read_loads
from moeserve.perf.deploy import Instance


def rank_imbalance(loads: list[float], ranks: int) -> float:
    """max/mean of per-rank sums when experts are placed contiguously (expert e on rank e*ranks//E)."""
    n = len(loads)
    if n == 0 or ranks < 1 or sum(loads) <= 0:
        return 1.0
    per_rank = [0.0] * ranks
    for e, load in enumerate(loads):
        per_rank[e * ranks // n] += load
    return max(per_rank) / (sum(per_rank) / ranks)


class LoadSkew:
    """Expert loads read once; the imbalance factor of any layout, from its own EP size and redundant slots
    (a search or a separate prefill instance tries layouts other than --cards: each gets its own factor)."""

    def __init__(self, layers: dict[int, list[float]], balanced: bool = True):
        self.layers = [loads for loads in layers.values() if sum(loads) > 0]
        self.balanced = balanced
        self._factors: dict[tuple[int, int], float] = {}

    @classmethod
    def from_files(cls, paths: str | list[str], n_experts: int, balanced: bool = True) -> "LoadSkew":
        paths = [paths] if isinstance(paths, str) else list(paths)
        try:
            skew = cls(read_loads(paths, n_experts), balanced)
        except ValueError as err:
            raise ValueError(f"--eplb-stats {err}") from None
        if not skew.layers:
            raise ValueError(f"--eplb-stats {' '.join(paths)}: no layer records any routed tokens")
        return skew

    def factor(self, ranks: int, redundant: int = 0) -> float:
        """Mean over layers of max/mean rank load on `ranks` routed-expert ranks with `redundant` slots."""
        key = (ranks, redundant if self.balanced else 0)  # contiguous blocks ignore spare slots
        if key not in self._factors:
            if self.balanced:
                f = [imbalance(rebalance(loads, redundant, ranks), loads, ranks) for loads in self.layers]
            else:
                f = [rank_imbalance(loads, ranks) for loads in self.layers]
            self._factors[key] = max(1.0, sum(f) / len(f)) if f else 1.0
        return self._factors[key]

    def apply(self, inst: Instance) -> Instance:
        """`inst` with the factor of its own layout."""
        if self.layers:
            inst.expert_slots(len(self.layers[0]))  # the layout's own error if slots do not split
        return replace(inst, imbalance=self.factor(inst.ep, inst.redundant_experts))


def imbalance_from_file(paths: str | list[str], n_experts: int, ranks: int, redundant: int = 0,
                        balanced: bool = True) -> float:
    return LoadSkew.from_files(paths, n_experts, balanced).factor(ranks, redundant)
