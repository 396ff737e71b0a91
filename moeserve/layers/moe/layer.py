"""One MoE block: Router -> placement map -> Dispatch -> Experts -> Combine, plus the shared experts.

With a TP group of T > 1 every TP rank holds the same tokens after attention; each takes its 1/T share of
the rows into the MoE (so no pair is dispatched twice) and the TP group gathers the outputs back.
The shared experts run on this rank's rows while the dispatch transfer is in flight.
"""
from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.comm import timed
from moeserve.distributed.flashcomm import current_seq_parallel
from moeserve.distributed.parallel_state import get_ep_group, get_ep_hierarchy, get_tp_group
from moeserve.layers.attention.metadata import get_attention_metadata
from moeserve.layers.mlp import DenseMLP
from moeserve.layers import opaque
from moeserve.layers.moe.dispatch import LocalDispatcher, make_codec, make_dispatcher
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.moe.load_stats import current_recorder
from moeserve.layers.moe.placement import (ExpertMap, current_comm_dtype, current_layer_placement,
                                           current_node_size, current_pipeline_chunks)
from moeserve.layers.moe.router import Router
from moeserve.arch import DeepseekArch


class MoE(nn.Module):
    def __init__(self, arch: DeepseekArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(arch)
        comm, placement = current_layer_placement(layer_idx, arch.n_routed_experts)
        self.tp, ep = get_tp_group(), get_ep_group()
        sharded = placement.experts_tp_sharded
        local_slots = placement.local_slot_experts()
        self.experts = FusedExperts(len(local_slots), arch.hidden_size, arch.moe_intermediate_size,
                                    local_slots, shard_rank=ep.rank if sharded else 0,
                                    num_shards=ep.world_size if sharded else 1)
        self.expert_map = ExpertMap(placement)
        # --shared-expert-ranks: the shared experts live on those ranks only, as one more dispatch destination
        self.shared_remote = placement.num_shared_ranks > 0
        holds_shared = not self.shared_remote or placement.holds_shared
        self.shared_experts = (DenseMLP(arch.hidden_size, arch.moe_intermediate_size * arch.n_shared_experts)
                               if arch.n_shared_experts and holds_shared else None)
        self.placement = placement
        codec = make_codec(current_comm_dtype())
        node, chunks = current_node_size(), current_pipeline_chunks()
        self.dispatcher = make_dispatcher(comm, ep, placement, codec, node, get_ep_hierarchy(), chunks)
        mb1 = get_ep_group(micro_batch=1)  # --enable-dbo: micro-batch 1's own process groups
        self.dispatchers = [self.dispatcher] + (
            [make_dispatcher(comm, mb1, placement, codec, node, get_ep_hierarchy(micro_batch=1), chunks)]
            if mb1 is not ep else [])
        self.op_key = opaque.register(self)

    @property
    def local_shared(self) -> DenseMLP | None:
        """The shared experts this rank adds to its own rows (None: none, or on --shared-expert-ranks)."""
        return None if self.shared_remote else self.shared_experts

    @property
    def expert_compute(self):
        """What the dispatcher runs on the rows this rank receives: its routed experts, or on a shared-expert
        rank the shared MLP (a property: quantization may replace self.experts after construction)."""
        return SharedExpertsAsSlot(self.shared_experts) if self.placement.holds_shared else self.experts

    # Expert-load recording (--expert-load-stats, --enable-eplb) is on: a compiled graph then keeps the routed
    # part opaque, where the op records the loads and maps them to slots eagerly (the map moves with EPLB)
    records_load = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.tp.world_size > 1:  # row shares and the TP gather: the whole block is one opaque op
                return torch.ops.moeserve.moe_block(x, self.op_key)
            if self.records_load or not self.routed_traceable(x.shape[0]):
                return self._forward_opaque(x)
        return self.eager_block(x)

    def eager_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.middle(self.start(x)))

    def routed_traceable(self, tokens: int) -> bool:
        """Whether a compiled graph can trace the routed experts of `tokens` rows: one rank holds them all (no
        collectives) and the experts can be traced over that many pairs (FusedExperts.traceable)."""
        return isinstance(self.dispatcher, LocalDispatcher) and self.experts.traceable(tokens * self.gate.top_k)

    def _forward_opaque(self, x: torch.Tensor) -> torch.Tensor:
        """The compiled graph's MoE block when the routed part is an opaque op (layers/opaque.py): router and
        (single-rank) shared experts in the graph, dispatch -> experts -> combine in the op. One TP rank."""
        weights, expert_ids = self.gate(x)
        out = torch.ops.moeserve.moe_routed(x, weights, expert_ids, self.op_key)
        if self.local_shared is not None and isinstance(self.dispatcher, LocalDispatcher):
            out = out + self.local_shared(x)
        return out

    def routed_eager(self, rows: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """moe_routed's body: as start/middle/finish without the router. With a transfer in flight the shared
        experts run under it here, as in middle(). The router's logical ids are recorded and mapped to slots
        here, with the layer's current map (online EPLB moves experts under a compiled graph)."""
        ids = self._to_slots(expert_ids, rows.shape[0], rows.shape[0], False)
        handle = self._dispatch(self.dispatcher, rows, weights, ids)
        shared = None
        if self.local_shared is not None and not isinstance(self.dispatcher, LocalDispatcher):
            with timed("shared_experts"):
                shared = self.local_shared(rows)
        out = self.dispatcher.combine_finish(self.dispatcher.combine_start(handle, self.expert_compute))
        return out if shared is None else out + shared

    def _to_slots(self, expert_ids: torch.Tensor, total: int, share: int, sharded: bool) -> torch.Tensor:
        """The router's logical ids [share, k] -> physical slots; with --expert-load-stats / --enable-eplb they
        are recorded first (logical loads, before replicas split them; the step's own rows only)."""
        recorder = current_recorder()
        if recorder is not None:
            recorder.record(self.layer_idx, expert_ids[: self._own_rows(total, share, sharded)])
        return self.expert_map.to_physical(expert_ids)

    def _own_rows(self, total: int, share: int, sharded: bool) -> int:
        """How many of this rank's `share` rows (of the block's `total`) are the step's own tokens: a compiled
        graph pads its bucket past them (the padding rows are last), which load statistics must not count."""
        meta = get_attention_metadata()
        real = total if meta is None else meta.slot_mapping.shape[0]
        if real >= total:
            return share
        start = 0
        if sharded:  # tensor_split's share of this TP rank
            w, r = self.tp.world_size, self.tp.rank
            start = r * (total // w) + min(r, total % w)
        return max(0, min(real - start, share))

    def _dispatch(self, dispatcher, rows: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor):
        """Start sending the (token, expert) pairs; with --shared-expert-ranks each token's shared-expert row
        is one more pair (weight 1) to its shared rank."""
        if self.shared_remote:
            phys_ids = torch.cat([phys_ids, self.placement.shared_destinations(rows.shape[0], rows.device)], 1)
            weights = torch.cat([weights, weights.new_ones(weights.shape[0], 1)], 1)
        return dispatcher.dispatch(rows, weights, phys_ids)

    # The three stages, apart so that --enable-dbo can interleave two micro-batches (models/deepseek_v3.py):
    # start (route, start sending rows) | middle (shared experts, wait for rows, experts, start the way back)
    # | finish (wait for the way back, sum).
    def start(self, x: torch.Tensor, micro_batch: int = 0) -> tuple:
        sharded = self.tp.world_size > 1 and current_seq_parallel() is None  # FlashComm: x is the shard already
        rows = x.tensor_split(self.tp.world_size)[self.tp.rank] if sharded else x  # [T_tp, H]
        with timed("router"):
            weights, expert_ids = self.gate(rows)  # [T_tp, k] float32, logical ids
            phys_ids = self._to_slots(expert_ids, x.shape[0], rows.shape[0], sharded)  # [T_tp, k] physical slots
        dispatcher = self.dispatchers[min(micro_batch, len(self.dispatchers) - 1)]
        return rows, sharded, dispatcher, self._dispatch(dispatcher, rows, weights, phys_ids)

    def middle(self, state: tuple) -> tuple:
        rows, sharded, dispatcher, handle = state
        shared = None
        if self.local_shared is not None:  # on this rank's rows while they travel
            with timed("shared_experts"):
                shared = self.local_shared(rows)
        return shared, sharded, dispatcher, dispatcher.combine_start(handle, self.expert_compute)

    def finish(self, state: tuple) -> torch.Tensor:
        shared, sharded, dispatcher, pending = state
        out = dispatcher.combine_finish(pending)
        if shared is not None:
            out = out + shared
        return self.tp.all_gather_varlen(out) if sharded else out


class SharedExpertsAsSlot:
    """On a --shared-expert-ranks rank, what the dispatcher calls in place of the routed experts: the shared MLP
    over the received rows whose slot is 0 (every row of an all-to-all; this rank's share of an all-gather),
    weighted like an expert's output; rows addressed elsewhere (-1) come back 0."""

    def __init__(self, mlp: DenseMLP) -> None:
        self.mlp = mlp

    def __call__(self, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w = self.mlp.down_proj.weight
        # an INT8 dispatch payload decodes to float32: back to the model dtype (INT8 weights quantize any float)
        x = rows if not w.is_floating_point() else rows.to(w.dtype)
        mine = (slots >= 0).nonzero().squeeze(1)
        if mine.numel() == rows.shape[0]:
            return (self.mlp(x).float() * weights[:, None]).to(x.dtype)
        out = torch.zeros_like(x)
        if mine.numel():
            out[mine] = (self.mlp(x[mine]).float() * weights[mine, None]).to(x.dtype)
        return out
