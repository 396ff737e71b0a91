"""Expert-parallel load balancing: replicate hot experts and pack slots so EP ranks carry equal load.

Given one layer's per-expert loads, R redundant slots and W ranks of (E + R) / W slots each:
1. replicas: each redundant slot goes to the expert with the highest load per replica (the engine spreads
   an expert's (token, choice) pairs round-robin over its replicas, so each carries load / replicas);
2. packing: replicas in decreasing load, each onto the least-loaded rank that still has a free slot and
   does not hold that expert yet (a second copy on the same rank would not spread anything).
The result is a phys_to_logical map in the engine's --expert-placement format (layers/moe/placement.py).
"""
from __future__ import annotations


def replica_counts(loads: list[float], num_redundant: int) -> list[int]:
    reps = [1] * len(loads)
    for _ in range(num_redundant):
        e = max(range(len(loads)), key=lambda i: (loads[i] / reps[i], -i))
        reps[e] += 1
    return reps


def rebalance(loads: list[float], num_redundant: int, num_ranks: int) -> list[int]:
    """phys_to_logical of len(loads) + num_redundant slots, rank r holding slots [r*S, (r+1)*S)."""
    n = len(loads)
    total = n + num_redundant
    if num_ranks < 1 or total % num_ranks:
        raise ValueError(f"{n} experts + {num_redundant} redundant slots do not split over {num_ranks} ranks")
    per_rank = total // num_ranks
    reps = replica_counts(loads, num_redundant)
    items = sorted(((loads[e] / reps[e], e) for e in range(n) for _ in range(reps[e])), key=lambda t: (-t[0], t[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for load, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < per_rank]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += load
    return [e for r in range(num_ranks) for e in held[r]]


def rank_loads(phys_to_logical: list[int], loads: list[float], num_ranks: int) -> list[float]:
    """Load each rank carries under a placement (replicas split their expert's load evenly)."""
    reps: dict[int, int] = {}
    for e in phys_to_logical:
        reps[e] = reps.get(e, 0) + 1
    per_rank = len(phys_to_logical) // num_ranks
    return [sum(loads[e] / reps[e] for e in phys_to_logical[r * per_rank:(r + 1) * per_rank])
            for r in range(num_ranks)]


def imbalance(phys_to_logical: list[int], loads: list[float], num_ranks: int) -> float:
    """max / mean rank load (1.0 = perfectly balanced)."""
    per = rank_loads(phys_to_logical, loads, num_ranks)
    mean = sum(per) / len(per)
    return max(per) / mean if mean > 0 else 1.0
