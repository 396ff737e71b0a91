"""Where the rank processes of a multi-rank engine come from.

- One node: the front end (LLM, or the server's engine-core process) spawns all D x T ranks locally.
- Several nodes (--nnodes N --node-rank i --master-addr A --master-port P): every node runs the same
  command; each spawns its D x T / N local ranks; node 0 also hosts the front end, which the TP-leader
  ranks reach over ZMQ at A:P+1 (torch.distributed uses A:P).
- torchrun: each torchrun process is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are honoured);
  RANK 0 hosts the front end and runs its own rank in a thread.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from moeserve.config import ConfigError, EngineConfig, ParallelConfig

# the folder holding the moeserve package: rank interpreters get it on PYTHONPATH (a checkout need not be installed)
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def detect(cls) -> "TorchrunEnv | None":
        env = os.environ
        if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", "127.0.0.1"),
                   int(env.get("MASTER_PORT", "29500")))


def resolve_endpoints(parallel: ParallelConfig, torchrun: TorchrunEnv | None) -> tuple[ParallelConfig, str, str]:
    """(parallel, torch.distributed init method, ZMQ address of the front end). Without torchrun on one node
    with no --master-port both ports are 0: the front end listens on ports the OS picks and tells the ranks
    those (DPEngineClient; a port picked, released and bound later could be taken meanwhile)."""
    if torchrun is not None:
        if torchrun.world_size != parallel.world_size:
            raise ConfigError(f"torchrun started {torchrun.world_size} processes but --data-parallel-size x "
                              f"--tensor-parallel-size is {parallel.world_size}; make them agree")
        parallel = dataclasses.replace(parallel, master_addr=torchrun.master_addr, master_port=torchrun.master_port)
        return parallel, "env://", f"tcp://{torchrun.master_addr}:{torchrun.master_port + 1}"
    addr, port = parallel.master_addr, parallel.master_port or 0
    zmq_port = port + 1 if parallel.nnodes > 1 else 0
    return parallel, f"tcp://{addr}:{port}", f"tcp://{addr}:{zmq_port}"


def check_parallel_layout(config: EngineConfig, arch, torchrun: TorchrunEnv | None = None) -> None:
    """Refuse layouts the model cannot take, before any process starts (messages name the flag)."""
    from moeserve.engine.elastic import check_elastic
    from moeserve.layers.moe.placement import build_plan

    parallel = config.parallel
    check_backend(parallel)
    t = parallel.tensor_parallel_size
    if arch.num_attention_heads % t:
        raise ConfigError(f"--tensor-parallel-size {t} does not divide the model's {arch.num_attention_heads} "
                          "attention heads; choose a divisor")
    build_plan(parallel, arch, 0, mtp=config.speculative is not None)
    check_elastic(config, arch, torchrun is not None)  # --enable-elastic-ep: a layout that survives a loss
    if config.speculative is not None:  # else every rank would load the model and then fail on its own
        from moeserve.models.loader import has_mtp_tensors
        from moeserve.speculative.mtp_model import missing_mtp_layer

        if arch.num_nextn_predict_layers < 1 or not has_mtp_tensors(config.model.model, arch.num_hidden_layers):
            raise ConfigError(missing_mtp_layer(arch))


def check_backend(parallel: ParallelConfig) -> None:
    """NCCL needs a CUDA build of torch and a GPU; without them every rank would fail at init, one by one."""
    if parallel.distributed_backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        why = "has no NCCL" if not (dist.is_available() and dist.is_nccl_available()) else "sees no CUDA device"
        raise ConfigError(f"--distributed-backend nccl: this torch ({torch.__version__}) {why}; "
                          "use --distributed-backend gloo (or auto)")


def make_engine_core(config: EngineConfig, arch=None, prespawned: "dict[int, subprocess.Popen] | None" = None):
    """EngineCore in this process, or the front end of D x T rank processes (same interface).

    On a node (or torchrun process) that does not host the front end this serves its ranks until node 0
    shuts them down, then exits the process. prespawned: this node's rank processes, started ahead
    (spawn_rank_processes) and waiting for their configuration, used instead of fresh ones.
    """
    from moeserve.engine.engine_core import EngineCore
    from moeserve.arch import DeepseekArch

    arch = arch or DeepseekArch.from_pretrained(config.model.model)
    torchrun = TorchrunEnv.detect()
    if not needs_ranks(config.parallel, torchrun):
        return EngineCore(config, arch)
    check_parallel_layout(config, arch, torchrun)
    if not hosts_front_end(config.parallel, torchrun):
        run_ranks_only(config, torchrun)
        raise SystemExit(0)
    from moeserve.engine.dp_client import DPEngineClient
    return DPEngineClient(config, torchrun, prespawned)


def run_ranks_only(config: EngineConfig, torchrun: TorchrunEnv | None) -> None:
    """A node (or torchrun process) without the front end: run its ranks until the front end stops them."""
    parallel, init_method, zmq_addr = resolve_endpoints(config.parallel, torchrun)
    config = dataclasses.replace(config, parallel=parallel)  # keeps quant, speculative, ...
    if torchrun is not None:
        from moeserve.engine.dp_worker import rank_main
        rank_main(msgspec.msgpack.encode(config), torchrun.rank, init_method, zmq_addr, None, 1)
        return
    ranks = LocalRanks(config, init_method, zmq_addr)
    ranks.join()
    bad = {r: c for r, c in ranks.dead().items() if c != 0}
    if bad:
        raise RuntimeError(f"rank(s) {sorted(bad)} on node {parallel.node_rank} failed (exit codes {bad})")


def needs_ranks(parallel: ParallelConfig, torchrun: TorchrunEnv | None) -> bool:
    return parallel.world_size > 1 or torchrun is not None


def hosts_front_end(parallel: ParallelConfig, torchrun: TorchrunEnv | None) -> bool:
    return torchrun.rank == 0 if torchrun is not None else parallel.node_rank == 0


def local_rank_processes(config: EngineConfig) -> bool:
    """Whether this process, as the engine core, runs rank processes of its own (not under torchrun)."""
    torchrun = TorchrunEnv.detect()
    return torchrun is None and needs_ranks(config.parallel, None) and hosts_front_end(config.parallel, None)


def spawn_rank_processes(config: EngineConfig) -> dict[int, subprocess.Popen]:
    """Start this node's rank interpreters (`python -m moeserve.engine.dp_worker`): each imports torch and the
    engine, then waits on stdin for its rendezvous addresses and EngineConfig (LocalRanks writes them). A
    standby engine core (entrypoints/launcher.py) starts them ahead, so a restart does not wait for those
    imports; a rank whose stdin closes with nothing written exits at once."""
    p = config.parallel
    first = p.node_rank * p.ranks_per_node
    return {rank: _spawn_rank(config, rank) for rank in range(first, first + p.ranks_per_node)}


def _spawn_rank(config: EngineConfig, rank: int, join: bool = False) -> subprocess.Popen:
    threads = max(1, (os.cpu_count() or 1) // config.parallel.ranks_per_node)
    env = dict(os.environ)
    root = str(PACKAGE_PARENT)
    env["PYTHONPATH"] = os.pathsep.join([root] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    cmd = [sys.executable, "-m", "moeserve.engine.dp_worker", "--rank", str(rank), "--parent-pid",
           str(os.getpid()), "--threads", str(threads)] + (["--join"] if join else [])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)


class LocalRanks:
    """The rank processes this node runs (or, under torchrun, this process's rank in a thread).

    Ranks are fresh interpreters (`python -m moeserve.engine.dp_worker`, spawn_rank_processes) that read their
    rendezvous addresses and EngineConfig as msgpack from stdin: no pickling, and no re-import of the user's
    __main__ module.
    """

    def __init__(self, config: EngineConfig, init_method: str, zmq_addr: str,
                 torchrun: TorchrunEnv | None = None,
                 prespawned: dict[int, subprocess.Popen] | None = None) -> None:
        payload = msgspec.msgpack.encode(config)
        self.procs: dict[int, subprocess.Popen] = {}
        self.spares: dict[int, subprocess.Popen] = {}  # --elastic-ep-replace: started, waiting on stdin
        self.thread: threading.Thread | None = None
        if torchrun is not None:
            from moeserve.engine.dp_worker import rank_main
            self.thread = threading.Thread(target=rank_main, daemon=True, name=f"rank{torchrun.rank}",
                                           args=(payload, torchrun.rank, init_method, zmq_addr, None, 1))
            self.thread.start()
            return
        if prespawned and any(proc.poll() is not None for proc in prespawned.values()):
            for proc in prespawned.values():  # one died while waiting: start afresh
                proc.kill()
                proc.wait()
            prespawned = None
        self.procs = prespawned or spawn_rank_processes(config)
        self.start = msgspec.msgpack.encode([init_method, zmq_addr, payload])
        self.config = config
        for proc in self.procs.values():
            proc.stdin.write(self.start)
            proc.stdin.close()

    def spawn_spare(self, rank: int) -> None:
        """--elastic-ep-replace: start rank process `rank` ahead of need; it imports torch and the engine, then
        waits on stdin (as a standby engine core's ranks do) until spawn_replacement(rank) sends it on."""
        self.spares[rank] = _spawn_rank(self.config, rank, join=True)

    def spawn_replacement(self, rank: int) -> None:
        """--elastic-ep-replace: rank process `rank` (a number no process had) that joins the running engine's
        next epoch instead of starting one (dp_worker --join): the spare of that number if it is alive, else
        a fresh one."""
        proc = self.spares.pop(rank, None)
        if proc is None or proc.poll() is not None:
            proc = _spawn_rank(self.config, rank, join=True)
        proc.stdin.write(self.start)
        proc.stdin.close()
        self.procs[rank] = proc

    def dead(self) -> dict[int, int]:
        """rank -> exit code of local ranks that have exited."""
        return {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}

    def stopped(self) -> list[int]:
        """Local ranks whose process is stopped (SIGSTOP, a debugger): state T or t in /proc/PID/stat. Empty
        where /proc is not there (not Linux)."""
        out = []
        for rank, p in self.procs.items():
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]  # after "pid (comm)"
            except (OSError, IndexError):
                continue
            if state in ("T", "t"):
                out.append(rank)
        return out

    def join(self, timeout: float | None = None) -> None:
        """Wait for the ranks, at most `timeout` seconds in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(None if deadline is None else max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.thread is not None:
            self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def kill_rank(self, rank: int) -> None:
        """SIGKILL one rank (--enable-elastic-ep: a stopped rank is dropped, the others ride through)."""
        p = self.procs[rank]
        if p.poll() is None:
            p.kill()
        p.wait(5)

    def kill(self) -> None:
        for p in self.spares.values():
            p.kill()
        for p in self.spares.values():
            p.wait(5)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(5)
