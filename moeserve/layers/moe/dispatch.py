"""Dispatch/combine: how token rows reach the experts that hold them and come back.

Every dispatcher has the same calls, so the MoE layer can overlap work (the shared experts, or with
--enable-dbo the other micro-batch) with the communication in between:
  handle = dispatcher.dispatch(x, weights, phys_ids)   # starts the (async) transfer of token rows
  out = dispatcher.combine(handle, experts)            # waits, runs the local experts, returns [T, H]
combine is combine_finish(combine_start(handle, experts)): start waits for the rows, runs the experts and
starts the way back; finish waits for it and sums.
phys_ids are physical expert slots (placement.ExpertMap already chose a replica for each pair); with
--shared-expert-ranks one more column addresses each token's shared-expert rank (weight 1), and on that
rank `experts` is the shared MLP (layers/moe/layer.py SharedExpertsAsSlot).

- LocalDispatcher: one rank holds every slot.
- AllToAllDispatcher: each (token, choice) pair's row goes to the rank owning its slot (all_to_all with
  per-rank split sizes), the expert outputs come back the same way and are weighted and summed here.
- AllGatherDispatcher: all ranks' tokens are gathered, each rank computes the pairs whose slot it holds
  (or, with TP-sharded experts, its intermediate slice of every pair) and reduce-scatter returns the sums;
  TwoStageAllGatherDispatcher (--moe-comm-hierarchy two-stage) does both in two stages, across nodes and
  inside them, so that inter-node links carry each byte once.
Dispatch payloads go through a PayloadCodec: the identity, or Int8PayloadCodec (--moe-comm-dtype int8:
int8 rows + one float32 scale per row, sent as two concurrent collectives, ~half the bytes). The way back
(combine) always travels in the activation dtype.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeserve.distributed.comm import STATS, GroupCoordinator, timed
from moeserve.int8 import quantize_per_token
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.moe.placement import LayerPlacement


class PayloadCodec:
    """Identity codec: the rows travel in the activation dtype. encode -> tensors with the rows' dim 0."""

    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return [rows.contiguous()]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0]


class Int8PayloadCodec(PayloadCodec):
    """Rows [N, H] -> (int8 [N, H], float32 scale [N, 1]) per token; decode gives float32 rows, which INT8
    experts re-quantize to the same int8 values (same per-row scale), so INT8 dispatch == local INT8."""

    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        q, scale = quantize_per_token(rows.reshape(-1, rows.shape[-1]))
        return [q.contiguous(), scale.contiguous()]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        q, scale = parts
        return q.float() * scale


def make_codec(comm_dtype: str) -> PayloadCodec:
    if comm_dtype == "int8":
        return Int8PayloadCodec()
    if comm_dtype == "bfloat16":
        return PayloadCodec()
    raise ValueError(f"unknown --moe-comm-dtype {comm_dtype!r}")


def _weighted_sum(pair_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pair_out [T*k, H] unweighted expert outputs, weights [T, k] -> [T, H] (as LocalDispatcher sums)."""
    t, k = weights.shape
    weighted = (pair_out.float() * weights.reshape(-1, 1)).to(dtype)
    return weighted.view(t, k, pair_out.shape[-1]).sum(dim=1)


class _Dispatcher:
    def combine(self, handle, experts: FusedExperts) -> torch.Tensor:
        return self.combine_finish(self.combine_start(handle, experts))


class LocalDispatcher(_Dispatcher):
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor):
        return x, weights, phys_ids

    def combine_finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def combine_start(self, handle, experts: FusedExperts) -> torch.Tensor:
        """x [T, H]; weights, phys_ids [T, k] -> [T, H]."""
        x, weights, phys_ids = handle
        with timed("experts"):
            return experts.forward_topk(x, phys_ids, weights)


@dataclass
class _A2AHandle:
    x: torch.Tensor  # [T, H] this rank's tokens
    weights: torch.Tensor  # [T, k]
    order: torch.Tensor  # [T*k] pair index of each sent row (sorted by destination rank)
    send_counts: list[int]
    recv_counts: list[int]
    parts: list  # (tensor, work) of the encoded rows in flight
    slots: tuple  # (tensor, work) local slot of each received row


@dataclass
class _A2AReturn:
    back: tuple  # (tensor, work): expert outputs coming back, in send order
    order: torch.Tensor
    weights: torch.Tensor
    dtype: torch.dtype


class AllToAllDispatcher(_Dispatcher):
    def __init__(self, group: GroupCoordinator, placement: LayerPlacement, codec: PayloadCodec | None = None):
        self.group, self.placement = group, placement
        self.codec = codec or PayloadCodec()

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor) -> _A2AHandle:
        return self.dispatch_chunks([(x, weights, phys_ids)])[0]

    def dispatch_chunks(self, chunks: list[tuple]) -> list[_A2AHandle]:
        """Start the transfers of several (x, weights, phys_ids) chunks: one exchange of all their split sizes
        (a blocking collective), then every chunk's rows in flight at once."""
        with timed("dispatch"):
            w = self.group.world_size
            dests = [self.placement.rank_of(p.reshape(-1)) for _, _, p in chunks]
            sends = torch.stack([torch.bincount(d, minlength=w) for d in dests])  # [C, W]
            recvs = self.group.exchange_counts(sends)
            return [self._send(x, weights, phys_ids, dest, send.tolist(), recv)
                    for (x, weights, phys_ids), dest, send, recv in zip(chunks, dests, sends, recvs)]

    def _send(self, x: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor, dest: torch.Tensor,
              send_counts: list[int], recv_counts: list[int]) -> _A2AHandle:
        with timed("dispatch"):
            k, flat = phys_ids.shape[1], phys_ids.reshape(-1)  # [T*k]
            order = dest.argsort(stable=True)  # pairs grouped by destination rank
            rows = x.index_select(0, order // k)  # [T*k, H] in send order
            parts = [self.group.all_to_all(p, send_counts, recv_counts, async_op=True)
                     for p in self.codec.encode(rows)]
            slots = self.group.all_to_all(self.placement.local_slot(flat[order]).to(torch.int32).contiguous(),
                                          send_counts, recv_counts, async_op=True, kind="alltoall_meta")
        return _A2AHandle(x, weights, order, send_counts, recv_counts, parts, slots)

    def combine_start(self, h: _A2AHandle, experts: FusedExperts) -> _A2AReturn:
        with timed("dispatch"):  # waiting for the rows is part of the dispatch
            for _, work in h.parts + [h.slots]:
                if work is not None:
                    work.wait()
            recv = self.codec.decode([t for t, _ in h.parts])  # [N_recv, H]
            slots = h.slots[0].long()
        with timed("experts"):
            y = experts(recv, slots, torch.ones(recv.shape[0], dtype=torch.float32))  # unweighted
        with timed("combine"):  # back in the activation dtype (an INT8 payload decodes to float32)
            y = y.to(h.x.dtype).contiguous()
            back = self.group.all_to_all(y, h.recv_counts, h.send_counts, async_op=True, kind="alltoall")
        return _A2AReturn(back, h.order, h.weights, h.x.dtype)

    def combine_finish(self, r: _A2AReturn) -> torch.Tensor:
        with timed("combine"):
            back, work = r.back  # [T*k, H] in send order
            if work is not None:
                work.wait()
            pair_out = torch.empty_like(back)
            pair_out[r.order] = back
            return _weighted_sum(pair_out, r.weights, r.dtype)


@dataclass
class _AGHandle:
    dtype: torch.dtype  # the activations' (partial sums are reduced in it)
    num_tokens: int
    width: int  # padded tokens per rank
    gathered: list  # (tensor, work): rows, weights, phys ids of all ranks


class AllGatherDispatcher(_Dispatcher):
    """Flat schedule: one all-gather over all EP ranks, one reduce-scatter back. node_size (ranks per node,
    real or --ranks-per-node) only splits the byte counters by link class: moe_intra_node / moe_inter_node."""

    def __init__(self, group: GroupCoordinator, placement: LayerPlacement, codec: PayloadCodec | None = None,
                 node_size: int | None = None):
        self.group, self.placement = group, placement
        self.codec = codec or PayloadCodec()
        self.node_size = node_size or group.world_size

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor) -> _AGHandle:
        return self.dispatch_chunks([(x, weights, phys_ids)])[0]

    def dispatch_chunks(self, chunks: list[tuple]) -> list[_AGHandle]:
        """Start gathering several (x, weights, phys_ids) chunks: one all-gather of every chunk's row count
        (blocking), then each chunk padded to its busiest rank and all of them in flight at once."""
        with timed("dispatch"):
            counts = torch.tensor([x.shape[0] for x, _, _ in chunks], device=self.group.device)
            widths = self.group.all_gather(counts, kind="counts").view(-1, len(chunks)).amax(dim=0).tolist()
            handles = []
            for (x, weights, phys_ids), width in zip(chunks, widths):
                padded = [_pad(p, width) for p in self.codec.encode(x)]
                meta = [_pad(weights, width), _pad(phys_ids, width, fill=-1)]
                handles.append(_AGHandle(x.dtype, x.shape[0], width, self._gather_start(padded + meta)))
            return handles

    def combine_start(self, h: _AGHandle, experts: FusedExperts) -> tuple:
        with timed("dispatch"):
            tensors = self._gather_finish(h.gathered)
            x = self.codec.decode(tensors[:-2])  # [W*width, H]
            weights, phys = tensors[-2], tensors[-1]  # [W*width, k]
        with timed("experts"):
            local = self._local_slots(phys)  # [W*width, k], -1 where another rank computes the pair
            k = phys.shape[1]
            rows = x.repeat_interleave(k, dim=0)
            partial = experts(rows, local.reshape(-1), weights.reshape(-1)).view(-1, k, x.shape[1]).sum(dim=1)
        with timed("combine"):
            return self._scatter_start(partial.to(h.dtype).contiguous()), h.num_tokens

    def combine_finish(self, pending: tuple) -> torch.Tensor:
        (out, work), num_tokens = pending
        with timed("combine"):
            if work is not None:
                work.wait()
            return out[:num_tokens]

    # The schedule: how the padded parts reach every rank and how the partial sums come back.
    def _gather_start(self, parts: list[torch.Tensor]) -> list:
        w, node = self.group.world_size, self.node_size
        for p in parts:
            _count_links(p, intra=node - 1, inter=w - node)
        return [self.group.all_gather(p, async_op=True) for p in parts]

    def _gather_finish(self, gathered: list) -> list[torch.Tensor]:
        for _, work in gathered:
            if work is not None:
                work.wait()
        return [t for t, _ in gathered]

    def _scatter_start(self, partial: torch.Tensor) -> tuple:
        w, node = self.group.world_size, self.node_size
        _count_links(partial, intra=(node - 1) / w, inter=(w - node) / w)
        return self.group.reduce_scatter(partial, async_op=True)

    def _local_slots(self, phys: torch.Tensor) -> torch.Tensor:
        if self.placement.experts_tp_sharded:
            return phys  # every slot is here (sliced); padding stays -1
        mine = (phys >= 0) & (self.placement.rank_of(phys) == self.placement.rank)
        return torch.where(mine, self.placement.local_slot(phys), torch.full_like(phys, -1))


class TwoStageAllGatherDispatcher(AllGatherDispatcher):
    """--moe-comm-hierarchy two-stage over M nodes of L ranks: the padded parts are gathered first across nodes
    (cross group: the M ranks with this rank's local index), then inside the node, so each byte crosses to
    another node once (inter-node bytes (M-1)/(W-L) of the flat gather's; intra-node ones grow to match). The
    partial sums come back the mirror way: reduce-scatter inside the node, then across nodes. The gathered rows
    are ordered (local index, node) instead of by rank, which nothing depends on: each row carries its routing."""

    def __init__(self, group: GroupCoordinator, placement: LayerPlacement, codec: PayloadCodec | None,
                 node: GroupCoordinator, cross: GroupCoordinator):
        super().__init__(group, placement, codec, node.world_size)
        self.node, self.cross = node, cross

    def _gather_start(self, parts: list[torch.Tensor]) -> list:
        for p in parts:
            _count_links(p, intra=0, inter=self.cross.world_size - 1)
        return [self.cross.all_gather(p, async_op=True) for p in parts]  # [M * width, ...] each

    def _gather_finish(self, gathered: list) -> list[torch.Tensor]:
        across = super()._gather_finish(gathered)
        for t in across:
            _count_links(t, intra=self.node.world_size - 1, inter=0)
        return [self.node.all_gather(t) for t in across]  # [L * M * width, ...], (local index, node) order

    def _scatter_start(self, partial: torch.Tensor) -> tuple:
        nodes, size = self.cross.world_size, self.node.world_size
        _count_links(partial, intra=(size - 1) / size, inter=0)
        mine = self.node.reduce_scatter(partial)  # [M * width, H]: this local index's rows of every node
        _count_links(mine, intra=0, inter=(nodes - 1) / nodes)
        return self.cross.reduce_scatter(mine, async_op=True)  # [width, H]: this rank's own tokens


class PipelinedDispatcher(_Dispatcher):
    """--moe-pipeline-chunks K: the tokens split into K chunks (in order; some may be empty, every rank
    issues K of everything), all chunks' transfers started at dispatch, then chunk by chunk: wait for its rows,
    run the experts, start its way back, while the later chunks' rows and the earlier chunks' results are
    still in flight. The time spent on a chunk (waiting for its rows, its experts, starting its way back)
    while another chunk's transfer was still in flight is added to the phase timer "moe_overlap"."""

    def __init__(self, inner: "AllToAllDispatcher | AllGatherDispatcher", chunks: int) -> None:
        self.inner, self.chunks = inner, chunks

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, phys_ids: torch.Tensor) -> list:
        parts = zip(x.tensor_split(self.chunks), weights.tensor_split(self.chunks), phys_ids.tensor_split(self.chunks))
        return self.inner.dispatch_chunks([tuple(t.contiguous() for t in p) for p in parts])

    def combine_start(self, handles: list, experts: FusedExperts) -> list:
        pending = []
        for i, h in enumerate(handles):
            t0 = time.perf_counter()
            pending.append(self.inner.combine_start(h, experts))
            later = handles[i + 1:] + [p for p in pending[:-1]]
            if any(_in_flight(x) for x in later):  # this chunk's compute ran under another's transfer
                STATS.add_time("moe_overlap", time.perf_counter() - t0)
        return pending

    def combine_finish(self, pending: list) -> torch.Tensor:
        return torch.cat([self.inner.combine_finish(p) for p in pending])


def _in_flight(x) -> bool:
    """Whether a transfer of a chunk (its dispatch handle or its pending way back) is still running."""
    if isinstance(x, _A2AHandle):
        transfers = x.parts + [x.slots]
    elif isinstance(x, _A2AReturn):
        transfers = [x.back]
    elif isinstance(x, _AGHandle):
        transfers = x.gathered
    else:  # the allgather dispatchers' pending combine: ((out, work), num_tokens)
        transfers = [x[0]]
    return any(work is not None and not work.is_completed() for _, work in transfers)


def _count_links(t: torch.Tensor, intra: float, inter: float) -> None:
    """Bytes this rank sends for a collective over tensor t, by link class: intra / inter times t's bytes."""
    nbytes = t.numel() * t.element_size()
    STATS.add_bytes("moe_intra_node", int(nbytes * intra))
    STATS.add_bytes("moe_inter_node", int(nbytes * inter))


def _pad(t: torch.Tensor, rows: int, fill=0) -> torch.Tensor:
    out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out


def make_dispatcher(comm: str, group: GroupCoordinator, placement: LayerPlacement,
                    codec: PayloadCodec | None = None, node_size: int | None = None,
                    hierarchy: tuple[GroupCoordinator, GroupCoordinator] | None = None, chunks: int = 1):
    """hierarchy: (node, cross-node) groups of --moe-comm-hierarchy two-stage; node_size: ranks per node, for
    the link-class byte counters of the flat schedule; chunks: --moe-pipeline-chunks."""
    if comm == "local" or group.world_size == 1:
        return LocalDispatcher()  # nothing travels: the payload dtype does not apply
    if comm == "alltoall":
        inner = AllToAllDispatcher(group, placement, codec)
    elif comm == "allgather":
        inner = (TwoStageAllGatherDispatcher(group, placement, codec, *hierarchy) if hierarchy is not None
                 else AllGatherDispatcher(group, placement, codec, node_size))
    else:
        raise ValueError(f"unknown MoE communication {comm!r}")
    return PipelinedDispatcher(inner, chunks) if chunks > 1 else inner
