"""Expert-load imbalance from EPLB statistics: max/mean per-rank load under a contiguous placement.

Input: JSON list of per-expert token counts, or a list of such lists (one per layer; the mean of the
per-layer factors is returned since every layer's busiest rank gates that layer).
"""
from __future__ import annotations

import json
from pathlib import Path


def rank_imbalance(loads: list[float], ranks: int) -> float:
    """max/mean of per-rank sums when experts are placed contiguously (expert e on rank e*ranks//E)."""
    n = len(loads)
    if n == 0 or ranks < 1 or sum(loads) <= 0:
        return 1.0
    per_rank = [0.0] * ranks
    for e, load in enumerate(loads):
        per_rank[e * ranks // n] += load
    return max(per_rank) / (sum(per_rank) / ranks)


def imbalance_from_file(path: str | Path, n_experts: int, ranks: int) -> float:
    data = json.loads(Path(path).read_text())
    layers = data if data and isinstance(data[0], list) else [data]
    for layer in layers:
        if len(layer) != n_experts:
            raise ValueError(f"{path}: a layer lists {len(layer)} expert loads, the model has {n_experts}")
    factors = [rank_imbalance(layer, ranks) for layer in layers]
    return max(1.0, sum(factors) / len(factors))
