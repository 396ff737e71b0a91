"""Elastic expert parallelism (--enable-elastic-ep): a DP/EP engine rides through the loss of a rank.

Lifecycle (stage 1 of issue 37; one node, TP 1, gloo):
  0. start-up: check_elastic() refuses a layout that could not survive a loss (dummy weights: nothing to
     re-read the lost experts from; PD transfer; torchrun), naming the flag.
  1. a rank process dies (its exit is seen by the front end, dp_client.py) or is stopped (SIGSTOP: after
     --engine-stall-timeout the front end kills it, then as 1).
  2. the survivors leave the step they are in: their gloo collective raises when the dead peer's sockets
     close, and a survivor that leaves shuts down all its connections of the epoch, so a survivor blocked on
     it raises too (the cascade ends every survivor's step; --distributed-timeout bounds the worst case).
     Each reports the error with its epoch and waits for the front end (ride_through()).
  3. the front end starts epoch e + 1: a TCPStore of its own on a fresh port, and to each survivor (in old
     rank order) a RankReform with its new rank and the new world size. Commands and reports of older epochs
     are dropped. Survivors check in at that store before they build process groups, reading the front end
     meanwhile, so a rank lost while re-forming starts epoch e + 2 at once (no rendezvous waits for it).
  4. each survivor joins the new process groups and rebuilds its engine core for the smaller EP group:
     survivor_parallel() recomputes the placement (default map; redundant slots added where the experts no
     longer divide over the ranks) and the loader reads this rank's experts, only those, from the checkpoint.
     Decode runs eagerly in a degraded epoch (no graph compile on the way back). It reports ready in the
     new epoch.
  5. when all are ready the front end re-queues every unfinished request with its tokens so far
     (EngineCoreRequest.output_token_ids, issue 31's resume): greedy and seeded outputs continue exactly where
     the front end last saw them. New requests that arrived meanwhile wait in the front end until then.
A second loss repeats 1-5 with one rank fewer; with no survivor left the engine is dead (EngineDeadError).

Stage 1 rebuilds each survivor's engine core: its KV cache and its requests are recomputed too (the prefix
cache starts empty), and every weight is read again (from the page cache). Next (docs/parallelism.md): fill the
new slots from replicas the survivors hold and a host copy, keep the survivors' KV, and let a replacement
rank join (stage 2).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import stat
import sys
import time

from moeserve.config import ConfigError, EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)

WAIT_POLL_MS = 100  # a survivor waiting for its re-formation checks the front end's liveness this often


def survivor_parallel(parallel: ParallelConfig, num_experts: int, alive: int, master_port: int) -> ParallelConfig:
    """The layout of `alive` survivors: one DP rank fewer per loss, redundant slots topped up so that the
    experts spread evenly (8 experts over 3 ranks: one replica more), options that need 2+ ranks off for 1."""
    redundant = parallel.num_redundant_experts
    redundant += -(num_experts + redundant) % alive
    many = alive > 1
    return dataclasses.replace(
        parallel, data_parallel_size=alive, master_port=master_port, num_redundant_experts=redundant,
        moe_node_size=None, enable_eplb=parallel.enable_eplb and many, enable_elastic_ep=many,
        moe_pipeline_chunks=parallel.moe_pipeline_chunks if many else 1)


def check_elastic(config: EngineConfig, arch, torchrun: bool = False) -> None:
    """Start-up refusal of a layout that cannot survive the loss of a rank (the flags are checked by
    ParallelConfig)."""
    from moeserve.layers.moe.placement import build_plan

    p = config.parallel
    if not p.enable_elastic_ep:
        return
    if torchrun:
        raise ConfigError("--enable-elastic-ep re-forms the rank processes the front end spawned; under torchrun "
                          "each process is a rank of torchrun's: start `moeserve` without torchrun")
    if config.model.load_format == "dummy":
        raise ConfigError("--enable-elastic-ep: with --load-format dummy the experts of a lost rank cannot be read "
                          "again (no checkpoint weights, and no replica or host copy yet): drop --load-format dummy "
                          "or --enable-elastic-ep")
    if config.kv_transfer is not None:
        raise ConfigError("--enable-elastic-ep does not yet combine with --kv-transfer-config (a lost rank's pulled "
                          "KV cannot be re-queued): drop one of them")
    after = survivor_parallel(p, arch.n_routed_experts or 0, p.data_parallel_size - 1, p.master_port or 1)
    try:
        build_plan(after, arch, 0, mtp=config.speculative is not None)
    except ConfigError as e:
        raise ConfigError(f"--enable-elastic-ep: after the loss of a rank the {after.world_size} survivors could "
                          f"not hold the experts: {e}") from None


# ---- a rank's side ---------------------------------------------------------------------------------------

def ride_through(worker) -> None:
    """Run the rank's loop (dp_worker.RankWorker); when a step fails, leave the epoch, wait for the front end's
    re-formation and serve in the new one. Returns when the front end shuts the engine down."""
    from moeserve.engine.dp_worker import EpochOver
    from moeserve.protocol import RankReport

    while True:
        reform = None
        try:
            worker.run()
            return
        except EpochOver as e:  # the front end saw the loss first; this rank's collective had not failed yet
            reform = e.reform
        except Exception as e:  # noqa: BLE001 - a peer died mid-step (or its collective timed out)
            _left(worker, e, RankReport)
        while True:
            _leave_epoch(worker)
            reform = reform or _wait_for_reform(worker)
            if reform is None:
                return
            try:
                _join_epoch(worker, reform)
                break
            except _Shutdown:
                return
            except EpochOver as e:  # another rank died while re-forming: the front end's next epoch
                reform = e.reform
            except Exception as e:  # noqa: BLE001 - the new groups failed: wait for the next epoch
                reform = None
                _left(worker, e, RankReport)


def _left(worker, e: Exception, report_cls) -> None:
    if worker.front_end_gone():
        raise e
    first = str(e).splitlines()[0] if str(e) else ""
    msg = f"{worker.info.describe()} left epoch {worker.epoch}: {type(e).__name__}: {first}"
    print(f"moeserve: {msg}", file=sys.stderr, flush=True)
    worker.report(report_cls(worker.info.dp_rank, error=msg))


def _leave_epoch(worker) -> None:
    """Close the epoch's connections, then drop the engine core and the process groups. Only the dead rank's
    neighbours in a ring all-gather see its sockets close; the other survivors wait on live ones, so every
    survivor that leaves shuts its connections down first: each blocked peer raises at once (waiting for
    the groups' last references to go would not do: a compiled graph or an async work may keep one)."""
    import torch

    from moeserve.distributed.parallel_state import destroy_distributed

    _shut_connections(worker.front_end_port)
    worker.core = worker.world = worker.tp = None
    torch._dynamo.reset()
    gc.collect()
    try:
        destroy_distributed()
    except Exception as e:  # noqa: BLE001 - a group of a dead peer may fail to close; the next epoch is new
        logger.warning("tearing down epoch %d's process groups: %s", worker.epoch, e)
    gc.collect()


def _shut_connections(keep_port: int) -> int:
    """Shut down every TCP connection of this process (gloo pairs, the old TCPStore) but the one to the
    front end (remote port keep_port). The descriptors stay open: their owners close them in teardown."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves the owner's descriptor
        except (OSError, ValueError):
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if sock.getpeername()[1] == keep_port:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:  # listening, or not connected
                continue
    return n


def _wait_for_reform(worker):
    """The front end's RankReform for a newer epoch; None at shutdown. Older commands (requests sent before
    the front end saw the loss) are dropped: the front end re-queues every request after the re-formation."""
    while True:
        if worker.front_end_gone():
            raise RuntimeError("the front-end process exited")
        if not worker.sock.poll(WAIT_POLL_MS):
            continue
        cmd = worker.decoder.decode(worker.sock.recv())
        if cmd.shutdown:
            return None
        if cmd.reform is not None and cmd.reform.epoch > worker.epoch:
            return cmd.reform


def epoch_store(init_method: str, timeout_s: float):
    """The front end's rendezvous store of one epoch (it lives as long as the front end keeps it)."""
    import datetime
    from urllib.parse import urlsplit

    import torch.distributed as dist

    url = urlsplit(init_method)
    return dist.TCPStore(url.hostname, url.port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _gather_survivors(worker, reform, store) -> None:
    """Wait until every survivor of the epoch has checked in at the front end's store, reading the front
    end meanwhile: a newer re-formation (another rank died while re-forming) or a shutdown ends the wait at
    once, where a process-group rendezvous would wait for the dead rank until --distributed-timeout."""
    from moeserve.engine.dp_worker import EpochOver

    store.set(f"joined/{reform.rank}", b"1")
    keys = [f"joined/{r}" for r in range(reform.world_size)]
    while not store.check(keys):
        if worker.front_end_gone():
            raise RuntimeError("the front-end process exited")
        if worker.sock.poll(WAIT_POLL_MS // 10):
            cmd = worker.decoder.decode(worker.sock.recv())
            if cmd.shutdown:
                raise _Shutdown()
            if cmd.reform is not None and cmd.reform.epoch > reform.epoch:
                raise EpochOver(cmd.reform)


class _Shutdown(Exception):
    """The front end shut the engine down while this rank re-formed."""


def _join_epoch(worker, reform) -> None:
    import datetime
    from urllib.parse import urlsplit

    import torch.distributed as dist

    from moeserve.distributed.parallel_state import RankInfo, init_distributed

    started = time.monotonic()
    base = worker.base_config
    url = urlsplit(reform.init_method)
    parallel = survivor_parallel(base.parallel, worker.arch.n_routed_experts or 0, reform.world_size, url.port)
    store = dist.TCPStore(url.hostname, url.port, None, False,
                          timeout=datetime.timedelta(seconds=parallel.distributed_timeout))
    _gather_survivors(worker, reform, store)
    # decode runs eagerly from here: compiling the new layout's decode graphs would hold every survivor for
    # 10-20 s on a CPU (benchmarks/elastic_ep.py), and the loss should cost seconds
    config = dataclasses.replace(base, parallel=parallel, model=dataclasses.replace(base.model, enforce_eager=True))
    worker.epoch = reform.epoch
    init_distributed(parallel, reform.rank, reform.init_method, store=store)
    worker.start(config, RankInfo.of(reform.rank, parallel))
    print(f"moeserve: pid {os.getpid()} joined epoch {reform.epoch} as rank {reform.rank} of {reform.world_size} "
          f"in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
