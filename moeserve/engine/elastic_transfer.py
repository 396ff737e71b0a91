"""Elastic EP (engine/elastic.py has the lifecycle), step 4: a survivor fills a new expert slot from a peer
that holds the expert, over the new epoch's process group, instead of reading it from the checkpoint.

Every rank of the epoch takes part once one kept its engine core: a survivor sends from the slots it held, a
rank that builds its core afresh (a replacement: elastic_replace.py) holds nothing and only receives, after its
build. One all-gather tells every rank what every other holds per MoE layer (its slots before the re-placement);
with the new map, which every rank has, each derives the same routes (peer_routes): a slot whose expert
the rank holds is a local copy, one a peer holds arrives from it (the holder that sends the fewest so far),
and only an expert nobody holds any more is read from the checkpoint. Then one all-to-all per expert tensor
of each layer where something moves (EPLB's weight moves do the same: layers/moe/eplb_online.py), from the
old slots, which serve no step any more.
"""
from __future__ import annotations

import torch

LOCAL, DISK = -1, -2  # a route: the rank holds the expert itself / nobody does (the checkpoint); else the peer


def peer_routes(held: list[list[int]], wants: list[list[int]]) -> list[list[int]]:
    """Per rank r and new slot j (expert wants[r][j]): LOCAL when held[r] has the expert, else the peer that
    sends it (the holder with the fewest sends so far, the lowest on ties: the copies spread over holders),
    else DISK. Deterministic: every rank computes the same routes from the same lists."""
    sets = [set(h) for h in held]
    sends = [0] * len(held)
    routes = []
    for r, row in enumerate(wants):
        out = []
        for e in row:
            if e in sets[r]:
                out.append(LOCAL)
                continue
            holders = [q for q, s in enumerate(sets) if q != r and e in s]
            if not holders:
                out.append(DISK)
                continue
            q = min(holders, key=lambda q: (sends[q], q))
            sends[q] += 1
            out.append(q)
        routes.append(out)
    return routes


def gather_held(group, slots: dict[int, list[int]]) -> dict[int, list[list[int]]]:
    """{layer: [the experts rank r's slots hold, for each rank]} from every rank's {MoE layer: its slots'
    experts} (every rank names the same layers; a rank building afresh holds []). Two all-gathers: the slot
    counts, then the lists padded to the longest (ranks of different degraded epochs may differ)."""
    layers = sorted(slots)
    n = max((len(s) for s in slots.values()), default=0)
    widths = group.all_gather(torch.tensor([[n]], dtype=torch.long)).view(-1).tolist()
    width = max(widths)
    rows = torch.full((1, len(layers) * width), -1, dtype=torch.long)
    for k, i in enumerate(layers):
        rows[0, k * width:k * width + len(slots[i])] = torch.tensor(slots[i], dtype=torch.long)
    table = group.all_gather(rows).view(group.world_size, len(layers), width).tolist()
    return {i: [[e for e in table[r][k] if e >= 0] for r in range(group.world_size)] for k, i in enumerate(layers)}


class SlotTransfer:
    """One layer's peer transfers: start() posts an async all-to-all per expert tensor (rows of the old
    tensors for each peer, in rank and slot order), finish() waits and writes what arrived into the new."""

    def __init__(self, group, routes: list[list[int]], wants: list[list[int]], have: dict[int, int]) -> None:
        me, w = group.rank, group.world_size
        self.group = group
        # (destination rank, old local slot) of each row this rank sends, in the order the receiver expects
        self.send = [[have[wants[r][j]] for j, src in enumerate(routes[r]) if src == me] for r in range(w)]
        self.arrive = [j for q in range(w) for j, src in enumerate(routes[me]) if src == q]  # new slots, in order
        self.recv_counts = [sum(src == q for src in routes[me]) for q in range(w)]
        self.works: list = []

    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """pairs: (old tensor, new tensor) of each expert tensor, both [slots, ...]."""
        counts = [len(x) for x in self.send]
        for old, new in pairs:
            if old.dtype.is_floating_point and old.element_size() == 1:  # FP8: gloo moves it as bytes
                old, new = old.view(torch.uint8), new.view(torch.uint8)
            rows = [old[s] for x in self.send for s in x]
            payload = torch.stack(rows) if rows else old.new_empty((0,) + tuple(old.shape[1:]))
            got, work = self.group.all_to_all(payload.contiguous(), counts, self.recv_counts, async_op=True,
                                              kind="elastic")
            self.works.append((new, got, work))

    def finish(self) -> int:
        for new, got, work in self.works:
            if work is not None:
                work.wait()
            for i, j in enumerate(self.arrive):
                new[j] = got[i]
        return len(self.arrive)
