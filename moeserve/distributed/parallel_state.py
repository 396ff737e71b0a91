"""One rank grid and its named groups: world, dp, tp, ep.

Global rank r = dp_rank * T + tp_rank (T = --tensor-parallel-size, D = --data-parallel-size):
  tp group of r: the T ranks of its DP rank (attention heads are sharded over it);
  dp group of r: the D ranks with its tp_rank;
  ep group:      all D x T ranks (MoE layers: whole experts with --enable-expert-parallel, otherwise every
                 expert TP-sharded over them).
Layers ask get_tp_group() / get_ep_group(); nothing else reads the world size. A process that never called
init_distributed() is the single-process engine: every group has one rank and collectives are identities.

Lifecycle: init_distributed() once per rank process (before the model is built) -> collectives ->
destroy_distributed() at exit.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from moeserve.config import ParallelConfig
from moeserve.distributed.comm import GroupCoordinator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    dp_rank: int
    tp_rank: int
    world_size: int

    @classmethod
    def of(cls, rank: int, parallel: ParallelConfig) -> "RankInfo":
        t = parallel.tensor_parallel_size
        return cls(rank, rank // t, rank % t, parallel.world_size)

    def describe(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}, tp {self.tp_rank})"


_GROUPS: dict[str, GroupCoordinator] = {}
_FLASHCOMM = ["off"]  # --flashcomm of this rank's grid (layers/models ask get_flashcomm())
_TP_DP_SWITCH = [False]  # --attention-tp-dp-switch


def _group(name: str) -> GroupCoordinator:
    g = _GROUPS.get(name)
    return g if g is not None else GroupCoordinator.single(name)


def get_world_group() -> GroupCoordinator:
    return _group("world")


def get_tp_group() -> GroupCoordinator:
    return _group("tp")


def get_dp_group() -> GroupCoordinator:
    return _group("dp")


def get_ep_group(micro_batch: int = 0) -> GroupCoordinator:
    """The EP group; with --enable-dbo micro-batch 1 has a process group of its own (same ranks), so the
    two micro-batches' transfers are ordered apart and can be in flight together."""
    return _group("ep") if micro_batch == 0 or "ep_mb1" not in _GROUPS else _group("ep_mb1")


def get_ep_hierarchy(micro_batch: int = 0) -> tuple[GroupCoordinator, GroupCoordinator] | None:
    """--moe-comm-hierarchy two-stage: (this rank's node group, its cross-node group of the ranks with the same
    local index), or None for the flat schedule."""
    mb = "_mb1" if micro_batch and "ep_node_mb1" in _GROUPS else ""
    if "ep_node" + mb not in _GROUPS:
        return None
    return _GROUPS["ep_node" + mb], _GROUPS["ep_cross" + mb]


def get_eplb_group() -> GroupCoordinator:
    """Online EPLB's weight transfers: a process group of their own (the EP ranks) when --enable-eplb, so they
    travel while the next step's MoE collectives run on the EP group."""
    return _group("eplb") if "eplb" in _GROUPS else _group("ep")


def get_flashcomm() -> str:
    return _FLASHCOMM[0]


def get_attention_tp_dp_switch() -> bool:
    return _TP_DP_SWITCH[0]


def is_initialized() -> bool:
    return bool(_GROUPS)


def resolve_backend(parallel: ParallelConfig, device: torch.device) -> str:
    if parallel.distributed_backend != "auto":
        return parallel.distributed_backend
    return "nccl" if device.type == "cuda" else "gloo"


def host_rendezvous(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A rendezvous store served by this process, listening on HOST only (torch's own binds every interface
    whatever HOST says). port 0: a port the OS picks, listening before anyone is told it (store.port): a port
    picked, released and bound later by another process can be taken meanwhile, and the ranks would meet
    whatever listens there."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # the store owns the listener from here and closes it when it goes
    return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def rendezvous_store(init_method: str, world_size: int, timeout: datetime.timedelta):
    """A client of the TCPStore a tcp://HOST:PORT init method names (the engine's front end serves it:
    host_rendezvous; every rank connects, rank 0 too). None for other init methods."""
    url = urlsplit(init_method)
    if url.scheme != "tcp":
        return None
    return dist.TCPStore(url.hostname, url.port, world_size, False, timeout=timeout)


def _interface_toward(host: str | None) -> str | None:
    """The interface this machine reaches `host` through (lo for a loopback address)."""
    from moeserve import netif
    if not host or netif.is_wildcard(host):
        return None
    try:
        addr = netif.resolve(host)
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: this only picks the route
            return netif.interface_of(s.getsockname()[0])
    except OSError:
        return None


def init_distributed(parallel: ParallelConfig, rank: int, init_method: str,
                     device: torch.device | None = None, store=None) -> RankInfo:
    """Join the process group of all D x T ranks and build the named sub-groups. store: a rendezvous store
    to use (elastic EP's epochs), instead of a client of the one a tcp:// init method names."""
    device = device or torch.device("cpu")
    info = RankInfo.of(rank, parallel)
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout)
    backend = resolve_backend(parallel, device)
    if store is None:
        store = rendezvous_store(init_method, parallel.world_size, timeout)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and store is not None:
        # gloo listens on the address the host name resolves to (often the external one): use the interface
        # that reaches the master address instead (lo on one node)
        iface = _interface_toward(urlsplit(init_method).hostname)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    if store is None:  # env:// (torchrun): its agent's store
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=parallel.world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=parallel.world_size, timeout=timeout)
    d, t = parallel.data_parallel_size, parallel.tensor_parallel_size
    world = list(range(d * t))
    # Every rank must create every group, in the same order (torch.distributed.new_group is collective).
    tp_groups = [[dp * t + i for i in range(t)] for dp in range(d)]
    dp_groups = [[dp * t + i for dp in range(d)] for i in range(t)]
    _FLASHCOMM[0] = parallel.token_sharding
    _TP_DP_SWITCH[0] = parallel.attention_tp_dp_switch
    _GROUPS["world"] = GroupCoordinator("world", world, rank, dist.group.WORLD, device)
    _GROUPS["ep"] = GroupCoordinator("ep", world, rank, dist.group.WORLD, device)
    if parallel.enable_eplb and len(world) > 1:
        _GROUPS["eplb"] = GroupCoordinator("ep", world, rank, dist.new_group(world, timeout=timeout), device)
    if parallel.enable_dbo and len(world) > 1:
        _GROUPS["ep_mb1"] = GroupCoordinator("ep", world, rank, dist.new_group(world, timeout=timeout), device)
    named = [("tp", tp_groups), ("dp", dp_groups)]
    if parallel.moe_comm_hierarchy == "two-stage":  # the MoE collectives' node and cross-node groups
        size = parallel.moe_node_ranks
        nodes = [world[n:n + size] for n in range(0, len(world), size)]
        cross = [[node[i] for node in nodes] for i in range(size)]  # one rank per node: the same local index
        for mb in ("", "_mb1") if parallel.enable_dbo else ("",):  # DBO's micro-batch 1 talks on groups of its own
            named += [("ep_node" + mb, nodes), ("ep_cross" + mb, cross)]
    for name, groups in named:
        for ranks in groups:
            pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                _GROUPS[name] = GroupCoordinator(name, ranks, rank, pg, device)
    logger.info("%s joined a grid of %d x %d ranks", info.describe(), d, t)
    return info


def destroy_distributed() -> None:
    _TP_DP_SWITCH[0] = False
    _GROUPS.clear()
    _FLASHCOMM[0] = "off"
    if dist.is_initialized():
        dist.destroy_process_group()
