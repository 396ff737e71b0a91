"""Online EPLB (`--enable-eplb`): re-place experts while serving, from the loads of the last interval.

System-brief item 5: per-expert load statistics in real time, hot experts replicated, placement recomputed
dynamically. Every `--eplb-step-interval` lockstep steps, on every rank at the same step boundary:
  1. each MoE layer's routed (token, choice) pairs per logical expert since the last rebalance are summed
     over the EP group in one all-reduce (every rank then holds the same totals);
  2. eplb.rebalance() turns them into a new phys_to_logical map, the same on every rank (deterministic);
  3. expert weights start moving to their new slots: the experts a slot needs from another rank travel in
     one async all-to-all per expert tensor from the lowest rank that held the expert (every rank derives
     who sends what to whom from the two maps, so nothing else is exchanged), on a process group of their
     own, while the next step runs on the old map;
  4. after that step, on every rank at the same boundary: wait for the transfers, fill each layer's new
     slot order (local copies + what arrived) and switch its ExpertMap and slot list to the new map.
Only placement changes: each (token, choice) pair is still computed by one copy of its expert with the
same weights, so outputs do not change (tested: a run that rebalances every few steps gives the tokens
of a run that never does).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from moeserve.distributed.parallel_state import get_ep_group, get_eplb_group
from moeserve.layers.moe.eplb import imbalance, rebalance
from moeserve.layers.moe.load_stats import ExpertLoadRecorder
from moeserve.layers.moe.placement import ExpertMap

logger = logging.getLogger(__name__)


class OnlineEPLB:
    """Lifecycle: built by the model runner over the MoE blocks (main model and MTP layer) -> its recorder
    counts every forward -> step_done() after every lockstep step -> rebalance() every `interval` steps."""

    def __init__(self, moe_blocks: list[nn.Module], num_experts: int, interval: int,
                 recorder: ExpertLoadRecorder | None = None) -> None:
        """recorder: the --expert-load-stats recorder when there is one (its totals keep counting; the
        window is their growth since the last rebalance), else an in-memory one."""
        self.blocks = {b.layer_idx: b for b in moe_blocks}
        self.num_experts, self.interval = num_experts, interval
        self.ep = get_ep_group()
        self.transfer_group = get_eplb_group()
        self.pending: list = []  # moves started by the last rebalance, applied after the next step
        self.recorder = recorder or ExpertLoadRecorder(None, num_experts)
        self._base: dict[int, torch.Tensor] = {}  # the recorder's totals at the last rebalance
        self.steps = 0
        self.num_rebalances = 0
        self.experts_moved = 0  # expert copies that crossed ranks

    def step_done(self) -> None:
        self.steps += 1
        if self.pending:  # the moves the last rebalance started ran under this step: apply them
            for move in self.pending:
                move.finish()
            self.pending = []
        if self.steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        before, after = [], []  # max/mean rank load of the moved layers under the old and the new map
        layers = sorted(self.blocks)
        windows = self.ep.all_reduce(torch.stack([self._window(i) for i in layers]))  # one collective: [L, E]
        for idx, row in zip(layers, windows.tolist()):
            block, old = self.blocks[idx], self.blocks[idx].expert_map.placement
            if not any(row):
                continue
            old_map = list(old.phys_to_logical)
            ranks = old.routed_ranks  # --shared-expert-ranks never take a routed expert
            new_map = rebalance([float(x) for x in row], old.num_physical - self.num_experts, ranks)
            was, now = imbalance(old_map, row, ranks), imbalance(new_map, row, ranks)
            if now >= was:  # no better than what runs (the same map included): moving weights buys nothing
                continue
            before.append(was)
            after.append(now)
            self.pending.append(self._start_move(block, old_map, new_map, replace(old, phys_to_logical=tuple(new_map))))
        self._base = {i: c.clone() for i, c in self.recorder.counts.items()}  # the next window starts now
        self.num_rebalances += 1
        if before and self.ep.rank == 0:
            logger.info("EPLB rebalance %d: %d of %d MoE layers re-placed, max/mean rank load %.3f -> %.3f "
                        "(mean over them, on the last %d steps' loads)", self.num_rebalances, len(before),
                        len(self.blocks), sum(before) / len(before), sum(after) / len(after), self.interval)

    def _window(self, idx: int) -> torch.Tensor:
        zero = torch.zeros(self.num_experts, dtype=torch.long)
        return self.recorder.counts.get(idx, zero) - self._base.get(idx, zero)

    def _start_move(self, block: nn.Module, old: list[int], new: list[int], placement) -> "_Move":
        """Start moving every expert tensor of the block ([slots, ...] stacked) into the new slot order."""
        w, me = self.ep.world_size, self.ep.rank
        s = len(old) // placement.routed_ranks  # ranks past the routed ones hold the shared experts, no slot
        holders = {}  # expert -> lowest rank that held it
        for slot, e in enumerate(old):
            holders.setdefault(e, slot // s)
        local_old = {e: j for j, e in reversed(list(enumerate(old[me * s:(me + 1) * s])))}  # expert -> my slot

        def remote(r: int) -> list[tuple[int, int]]:
            """(slot of rank r, expert) that rank r fetches from another rank, in slot order."""
            if r >= placement.routed_ranks:
                return []
            held = set(old[r * s:(r + 1) * s])
            return [(j, e) for j, e in enumerate(new[r * s:(r + 1) * s]) if e not in held]

        wanted = [remote(r) for r in range(w)]
        sends = [[e for _, e in wanted[r] if holders[e] == me] for r in range(w)]  # what I send rank r
        recv_from = [[(j, e) for j, e in wanted[me] if holders[e] == q] for q in range(w)]
        send_counts, recv_counts = [len(x) for x in sends], [len(x) for x in recv_from]
        self.experts_moved += sum(recv_counts)
        transfers = []
        for _, param in block.experts.named_parameters(recurse=False):
            t = param.data
            rows = [t[local_old[e]] for r in range(w) for e in sends[r]]  # copies: the old weights keep serving
            payload = torch.stack(rows) if rows else t.new_empty((0,) + tuple(t.shape[1:]))
            transfers.append((param, self.transfer_group.all_to_all(payload.contiguous(), send_counts, recv_counts,
                                                                    async_op=True, kind="eplb")))
        local = [(j, local_old[e]) for j, e in enumerate(new[me * s:(me + 1) * s]) if e in local_old]
        arrived = [j for q in range(w) for j, _ in recv_from[q]]
        return _Move(block, placement, transfers, local, arrived)


class _Move:
    """One layer's expert weights in flight to a new placement; finish() waits and switches to it."""

    def __init__(self, block: nn.Module, placement, transfers: list, local: list[tuple[int, int]],
                 arrived: list[int]) -> None:
        self.block, self.placement, self.transfers = block, placement, transfers
        self.local, self.arrived = local, arrived  # (new slot, old slot) kept here; new slots filled remotely

    def finish(self) -> None:
        # every transfer first: a peer lost mid-wait (elastic EP) must leave no tensor of the layer re-ordered
        # while the others and the map are not; the survivor then keeps a consistent layer
        for _, (_, work) in self.transfers:
            if work is not None:
                work.wait()
        for param, (got, _) in self.transfers:
            t = param.data
            out = torch.empty_like(t)
            for j, old_slot in self.local:
                out[j] = t[old_slot]
            for i, j in enumerate(self.arrived):
                out[j] = got[i]
            param.data.copy_(out)
        self.block.expert_map = ExpertMap(self.placement)
        self.block.experts.slot_experts = self.placement.local_slot_experts()
        repack = getattr(self.block.experts, "process_weights_after_loading", None)
        if repack is not None:  # INT8 experts: their oneDNN packs hold the old slots' weights
            repack()
        logger.debug("EPLB moved %d expert copies in layer %d", len(self.arrived), self.block.layer_idx)
