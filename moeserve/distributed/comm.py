"""Collectives of one process group, with byte accounting, and per-phase step timing.

GroupCoordinator wraps a torch.distributed group (or none, for a group of one rank, where every collective
is the identity). Each collective records the payload bytes this rank sends to other ranks under its kind
("alltoall", "allgather", "reduce_scatter", "allreduce", "broadcast"), so benchmarks and /metrics can see
what moved. Ring/pairwise algorithms are assumed: allgather of n bytes sends n * (W-1); reduce-scatter of
n bytes sends n * (W-1)/W; all-reduce 2 n (W-1)/W; all-to-all the rows addressed to other ranks.

StepStats (module-level, one per process: a rank is a process) accumulates bytes and phase seconds; the
engine resets it each step and reports it in EngineStats.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

PHASES = ("attention", "router", "dispatch", "experts", "combine", "shared_experts")


@dataclass
class StepStats:
    bytes: dict[str, int] = field(default_factory=dict)  # collective kind -> bytes sent by this rank
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    calls: dict[str, int] = field(default_factory=dict)  # collective kind -> number of calls

    def add_bytes(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def reset(self) -> "StepStats":
        """Return the accumulated stats and start afresh."""
        done = StepStats(self.bytes, self.seconds, self.calls)
        self.bytes, self.seconds, self.calls = {}, {}, {}
        return done


STATS = StepStats()

# Collectives this process has begun on groups of 2+ ranks. --enable-elastic-ep's hang check reads it
# (engine/elastic.py ProgressBeacon): every rank begins the same sequence, so the rank its peers wait for
# is the one whose count lags theirs.
BEGUN = [0]


class _PhaseTimer:
    __slots__ = ("phase", "start")

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        STATS.add_time(self.phase, time.perf_counter() - self.start)


def timed(phase: str):
    """Add the block's wall time to STATS under `phase`. Inside a compiled graph (engine/compiled_decode.py)
    there is no host clock to read between fused kernels: the block is then untimed (the step is timed
    whole), and the ops that stay outside the graph (attention, non-traceable MoE) time themselves."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _PhaseTimer(phase)


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupCoordinator:
    """One named group of ranks ("tp", "dp", "ep", "world") as seen from this rank."""

    def __init__(self, name: str, ranks: list[int], rank: int, group=None, device=None) -> None:
        self.name, self.ranks = name, list(ranks)
        self.rank = self.ranks.index(rank)  # rank within the group
        self.world_size = len(self.ranks)
        self.group = group
        self.device = device or torch.device("cpu")
        assert self.world_size == 1 or group is not None, f"group {name} of {self.world_size} ranks needs a process group"

    @classmethod
    def single(cls, name: str) -> "GroupCoordinator":
        return cls(name, [0], 0)

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size == 1:
            return x
        BEGUN[0] += 1
        STATS.add_bytes("allreduce", 2 * _nbytes(x) * (self.world_size - 1) // self.world_size)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, async_op: bool = False, kind: str = "allgather"):
        """Concatenate x [n, ...] (same n on every rank) along dim 0 -> [W * n, ...] (and a work handle)."""
        if self.world_size == 1:
            return (x, None) if async_op else x
        assert x.is_contiguous(), "all_gather needs a contiguous tensor"
        BEGUN[0] += 1
        out = x.new_empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]))
        STATS.add_bytes(kind, _nbytes(x) * (self.world_size - 1))
        work = _all_gather_single(out, x, group=self.group, async_op=async_op)
        return (out, work) if async_op else out

    def all_gather_varlen(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate x [n_i, ...] of different lengths along dim 0, in rank order."""
        if self.world_size == 1:
            return x
        sizes = self.all_gather(torch.tensor([x.shape[0]], device=self.device), kind="counts").tolist()
        padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        full = self.all_gather(padded).view(self.world_size, max(sizes), *x.shape[1:])
        return torch.cat([full[r, :n] for r, n in enumerate(sizes)])

    def reduce_scatter(self, x: torch.Tensor, async_op: bool = False, kind: str = "reduce_scatter"):
        """Sum x [W * n, ...] over ranks and keep this rank's [n, ...] share (and a work handle)."""
        if self.world_size == 1:
            return (x, None) if async_op else x
        assert x.shape[0] % self.world_size == 0 and x.is_contiguous()
        BEGUN[0] += 1
        out = x.new_empty((x.shape[0] // self.world_size,) + tuple(x.shape[1:]))
        STATS.add_bytes(kind, _nbytes(x) * (self.world_size - 1) // self.world_size)
        work = _reduce_scatter_single(out, x, group=self.group, async_op=async_op)
        return (out, work) if async_op else out

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   async_op: bool = False, kind: str = "alltoall"):
        """Rows x[sum(send_counts[:r]) : ...] go to rank r; returns [sum(recv_counts), ...] (and a handle)."""
        if self.world_size == 1:
            return (x, None) if async_op else x
        assert x.is_contiguous() and x.shape[0] == sum(send_counts)
        BEGUN[0] += 1
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        row = _nbytes(x[:1]) if x.shape[0] else 0
        STATS.add_bytes(kind, row * (sum(send_counts) - send_counts[self.rank]))
        work = dist.all_to_all_single(out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                                      group=self.group, async_op=async_op)
        return (out, work) if async_op else out

    def exchange_counts(self, send_counts: torch.Tensor) -> list:
        """send_counts [W] rows this rank sends to each rank -> rows it will receive from each; or [C, W] for
        C chunks at once (one collective) -> [C][W]."""
        if self.world_size == 1:
            return send_counts.tolist()
        per_rank = send_counts.reshape(-1, self.world_size).t().contiguous()  # [W, C]: row r goes to rank r
        recv = self.all_to_all(per_rank.to(self.device), [1] * self.world_size, [1] * self.world_size,
                               kind="counts")  # [W, C]: row r came from rank r
        return recv.t().tolist() if send_counts.dim() == 2 else recv.view(-1).tolist()

    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes:
        """Send a msgspec-encoded message from group rank src to all (length first, then the bytes)."""
        if self.world_size == 1:
            return payload
        BEGUN[0] += 1
        length = torch.tensor([len(payload) if self.rank == src else 0], dtype=torch.long)
        dist.broadcast(length, self.ranks[src], group=self.group)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src
               else torch.empty(int(length), dtype=torch.uint8))
        if int(length):
            STATS.add_bytes("broadcast", int(length) * (self.world_size - 1) if self.rank == src else 0)
            dist.broadcast(buf, self.ranks[src], group=self.group)
        return bytes(buf.numpy())
