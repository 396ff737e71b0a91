"""Elastic expert parallelism (--enable-elastic-ep): a DP/EP engine rides through the loss of a rank.

Lifecycle (issue 37; one node, TP 1, gloo):
  0. start-up: check_elastic() refuses a layout that could not survive a loss (dummy weights: nothing to
     re-read the lost experts from; PD transfer; torchrun), naming the flag.
  1. a rank process dies (its exit is seen by the front end, dp_client.py, whose re-formation bookkeeping is
     elastic_front.py), is stopped (SIGSTOP: after --engine-stall-timeout the front end kills it, then as 1) or
     hangs: each rank's ProgressBeacon publishes how many collectives it has begun in the epoch (ProgressBoard,
     a shared file); when none has changed for --elastic-ep-hang-timeout, the ranks whose count lags the
     others' (the one they wait for) are killed.
  2. the survivors leave the step they are in: their gloo collective raises when the dead peer's sockets
     close, and a survivor that leaves shuts down all its connections of the epoch, so a survivor blocked on
     it raises too (the cascade ends every survivor's step; --distributed-timeout bounds the worst case).
     Each rolls its engine core back to its last finished step (roll_back(): the step failed inside its
     forward, before the scheduler's update, so its requests stay scheduled with the KV of their finished
     steps; nothing of the interrupted step was registered in the prefix cache), reports the error with its
     epoch and waits for the front end (ride_through()).
  3. the front end starts epoch e + 1: a TCPStore of its own on a fresh port, and to each survivor (in old
     rank order) a RankReform with its new rank and the new world size. Commands and reports of older epochs
     are dropped. Survivors check in at that store before they build process groups, reading the front end
     meanwhile, so a rank lost while re-forming starts epoch e + 2 at once (no rendezvous waits for it).
     Past --elastic-ep-timeout, ranks the others wait on in the new epoch (the ProgressBoard names them) are
     killed and the rest re-form again; if none can be named the engine stops.
  4. each survivor joins the new process groups; all ranks of the epoch say (one all-gather: vote_maps() in
     elastic_placement.py, which holds the rest of this step) which rank they were and a fingerprint of their
     expert maps. A survivor keeps its engine core (keep_core(): non-expert weights, KV cache pool, prefix
     cache, scheduler) and re-places only its MoE slots for the new EP group (survivor_parallel(): one rank
     fewer, redundant slots topped up where the experts no longer divide over the ranks): when the ranks that
     kept their cores did so under the same maps, each keeps the experts it holds and takes a share of the
     lost rank's (keep_map()); a rank that builds afresh (a replacement) receives that map and takes the
     experts no survivor keeps (placement.given_maps); else all use the default map. A slot whose expert the
     rank holds (a replica included) is copied; one a peer holds arrives from it (elastic_transfer.py: every
     rank takes part once one kept its core; a rank building afresh leaves those experts unread at its build
     and receives them after it: elastic_replace.py); with --elastic-ep-host-copy one no survivor holds comes
     from a file a rank wrote (elastic_host_copy.py); the others are read from the checkpoint, only those
     experts (loader.load_expert_slots, loader.experts_supplied). Its dispatchers and online EPLB are rebuilt
     over the new groups (the MTP layer's MoE block is one more layer). Quantized experts (A8W8, FP8) are
     re-placed the same way, their scales with them; a core that cannot be kept (can_keep(): PD transfer,
     TP-sharded experts) is rebuilt from the checkpoint as before. It reports ready in the new epoch and
     serves at once, its decode steps eagerly: unless the engine was started eager (--enforce-eager), the new
     layout's decode graphs come back while it serves (_late_graphs, elastic_graphs.py): every rank of the
     epoch compiles them between steps, one bucket (or the prefill kernels) at a time, at the same lockstep
     rounds (each MoE layer's graph holds its dispatch collectives), when all are idle or after every few
     steps (--elastic-ep-graphs in-use-first: also a bucket the round's decodes need, before the step); a
     compile is not named by the hang check (compiling()), and a bucket runs through its graph once compiled.
  5. each survivor's ready report lists the requests it kept (RankReport.kept, with their output tokens);
     the front end has read the survivors' outputs of the older epoch before it (one socket per rank, in
     order), so a kept request whose count matches what it saw stays where it runs. Every other unfinished
     request (the lost rank's; one a survivor never read; one out of step, aborted there) is re-queued with
     its tokens so far (EngineCoreRequest.output_token_ids, issue 31's resume): greedy and seeded outputs
     continue exactly where the front end last saw them (to the rank that had it where it survived, else the
     least loaded). New requests that arrived meanwhile wait in the front end until then.
  6. --elastic-ep-replace (stage 2): the front end keeps a spare rank process started ahead (dp_worker --join,
     imports done, waiting on stdin: launch.LocalRanks.spawn_spare). On a loss it is sent on and is a member
     of the loss's epoch: once it says it is up (a report of JOINING_EPOCH) it gets its RankReform, and the
     survivors wait for it at the store. Without a spare a fresh one starts once the survivors serve, says
     it is up, and the front end starts the next epoch with the survivors and it (the survivors leave their
     step on the RankReform). The survivors keep their cores and requests (as in 4 and 5, the graphs compiled
     between steps) and the slots they hold, up to the full group's count per rank; the replacement builds its
     engine core for that map, with the experts no survivor keeps (those a survivor still holds in a slot it
     gives up, or as a replica, arrive from it; the rest from the host copy, else the checkpoint:
     elastic_replace.py), and the lost rank's requests are re-queued as in 5.
A second loss repeats 1-5 with one rank fewer; with no survivor left the engine is dead (EngineDeadError).

A loss costs the lost rank's requests (recomputed from their tokens), the survivors' interrupted step and,
without --enforce-eager, eager decode steps and a pause of one item's compile every few steps until the new
epoch's decode graphs are back (docs/parallelism.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import mmap
import os
import socket
import stat
import tempfile
import threading
import time

from moeserve.config import ConfigError, EngineConfig, ParallelConfig
from moeserve.engine.elastic_placement import can_keep, keep_core, roll_back, vote_maps
from moeserve.stderr_line import stderr_line

logger = logging.getLogger(__name__)

WAIT_POLL_MS = 100  # a survivor waiting for its re-formation checks the front end's liveness this often
BEAT_S = 0.05  # a rank's beacon publishes how many collectives it has begun this often
JOINING_EPOCH = -1  # the epoch of a replacement rank's reports before it joins one (--elastic-ep-replace)
BOARD_SLOTS = 256  # progress slots: one per rank process the front end ever starts (replacements included)


class EpochOver(Exception):
    """The front end re-forms the ranks (it saw a loss before this rank's collective did, or a replacement
    joins). Defined here, not in dp_worker: a rank process runs dp_worker as __main__, where a class of its
    own would be another class than the one `from moeserve.engine.dp_worker import` gives."""

    def __init__(self, reform) -> None:
        super().__init__(f"the front end re-forms the ranks as epoch {reform.epoch}")
        self.reform = reform


# ---- hung ranks: progress the front end can see -----------------------------------------------------------

class ProgressBoard:
    """A small shared file (in /dev/shm where there is one) with two u64 per rank process: the epoch it serves in
    and the collectives it has begun in that epoch (comm.BEGUN). Each rank's ProgressBeacon writes its slot,
    the front end reads them all (DPEngineClient._check_hung). One node only, as elastic EP is."""

    def __init__(self, path: str, slots: int, create: bool = False) -> None:
        self.path = path
        if create:
            with open(path, "wb") as f:
                f.write(bytes(16 * slots))
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 16 * slots)
        self._words = memoryview(self._map).cast("Q")  # aligned 8-byte stores: a reader sees old or new

    @staticmethod
    def path_for(front_end_port: int) -> str:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.path.join(folder, f"moeserve-elastic-{front_end_port}.progress")

    def write(self, slot: int, epoch: int, begun: int) -> None:
        self._words[2 * slot + 1] = begun
        self._words[2 * slot] = epoch

    def read(self, slot: int) -> tuple[int, int]:
        return self._words[2 * slot], self._words[2 * slot + 1]

    def unlink(self) -> None:
        """Remove the name (every rank has mapped it by then); the mapping lives on."""
        try:
            os.unlink(self.path)
        except OSError:
            pass


COMPILING = 1 << 62  # in a slot's epoch word while the rank builds its core or compiles its graphs (compiling())


class ProgressBeacon(threading.Thread):
    """A rank's thread that publishes, every BEAT_S, how many collectives the rank has begun in its epoch. It
    runs while the main thread computes (torch ops release the GIL; a Python busy loop yields it every few ms),
    so what it shows is the main thread's progress: a rank that begins no collective while its peers wait in
    one holds them up, whether it spins, blocks or waits for a lock."""

    def __init__(self, board: ProgressBoard, slot: int) -> None:
        super().__init__(daemon=True, name="elastic-ep-beacon")
        self.board, self.slot = board, slot
        self.epoch, self.base = 0, 0
        self.compiling = False  # compiling(): the front end neither names this rank hung nor times it out

    def new_epoch(self, epoch: int) -> None:
        """Count from here (called before the epoch's first collective): the survivors' histories differ."""
        from moeserve.distributed import comm

        self.base = comm.BEGUN[0]
        self.epoch = epoch

    def run(self) -> None:
        from moeserve.distributed import comm

        while True:
            self.board.write(self.slot, self.epoch | (COMPILING if self.compiling else 0), comm.BEGUN[0] - self.base)
            time.sleep(BEAT_S)


@contextlib.contextmanager
def compiling(worker):
    """While the rank builds its engine core or compiles its decode graphs (a stretch of seconds between two
    collectives, its peers waiting in the next one), its slot on the ProgressBoard says so: the hang check
    names no rank then (hung_ranks), and a re-formation's --elastic-ep-timeout counts from the compile's end
    (ElasticFront._poll_recovery). The peers' collectives still time out after --distributed-timeout."""
    beacon = worker.beacon
    if beacon is None:
        yield
        return
    beacon.compiling = True
    try:
        yield
    finally:
        beacon.compiling = False


def any_compiling(board, slots) -> bool:
    """Whether one of the ranks in `slots` says it compiles (compiling())."""
    return board is not None and any(board.read(r)[0] & COMPILING for r in slots)


def hung_ranks(beats: dict[int, tuple[int, int]], epoch: int) -> list[int]:
    """The ranks the others wait for, from beats {rank: (epoch, collectives begun)} that have not changed for
    --elastic-ep-hang-timeout: those whose count lags the highest. Every rank begins the same sequence of
    collectives, so a rank blocked in collective k + 1 has a higher count than the rank that never began it.
    None when a rank still shows an older epoch or compiles (its epoch word has COMPILING), or when all are
    level (all compute one long stretch, or all wait in one collective: --distributed-timeout ends that)."""
    if not beats or any(e != epoch for e, _ in beats.values()):
        return []
    counts = {r: c for r, (_, c) in beats.items()}
    low = min(counts.values())
    if low == max(counts.values()):
        return []
    return sorted(r for r, c in counts.items() if c == low)


# ---- testing only: a hung rank on demand -----------------------------------------------------------------

TEST_HANG_ENV = "MOESERVE_TEST_ELASTIC_HANG"  # testing only: "RANK:STEP:MODE[:SECONDS]" (tests/distributed)


def test_hang_hook(rank: int):
    """TESTING ONLY (tests/distributed/test_elastic_ep_hang.py). With MOESERVE_TEST_ELASTIC_HANG=RANK:STEP:MODE
    the rank process first started as RANK, at its STEP-th step (1-based, counted over its life), before the
    step's forward: MODE "spin" busy-loops forever, "block" waits forever on an event, "crawl:SECONDS" sleeps
    SECONDS before each collective of that step (a long step that makes progress); "die-in-move" SIGKILLs the
    process inside the first EPLB weight move it starts from that step on (--enable-eplb), once the move's
    first layer has posted its transfers and before the next; "spin-at-join" busy-loops once the rank has
    joined the process groups of the first epoch it re-forms into, before it builds its engine core (STEP
    unused); "spin-before-hello" busy-loops in a replacement (--elastic-ep-replace) before it says it is up;
    "other-maps" (not a hang) makes the rank vote another fingerprint of its expert maps in each re-formation,
    as a keeper left under other maps by a loss mid-re-formation would: every rank takes the default layout
    (STEP unused). STEP may be @PATH instead: the first step at
    which the file PATH exists (benchmarks/elastic_ep.py --hang creates it when it wants the fault). Returns a
    callable the worker runs before each step (with itself), or None."""
    spec = os.environ.get(TEST_HANG_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != rank:
        return None
    mode = parts[2]
    trigger = parts[1][1:] if parts[1].startswith("@") else None
    at = 0 if trigger else int(parts[1])
    count = [0]

    if mode == "other-maps":
        def other_maps(worker) -> None:
            pass

        other_maps.vote_other_maps = True  # elastic_placement.vote_maps
        return other_maps

    if mode in ("spin-at-join", "spin-before-hello"):
        def spin() -> None:
            stderr_line(f"moeserve: testing hook {TEST_HANG_ENV}: rank {rank} {mode}")
            while True:
                pass

        def no_step(worker) -> None:
            pass

        setattr(no_step, "at_join" if mode == "spin-at-join" else "before_hello", spin)
        return no_step

    def before_step(worker) -> None:
        nonlocal at
        count[0] += 1
        if trigger and not at and os.path.exists(trigger):
            at = count[0]
        if mode == "die-in-move":
            if count[0] == at:
                _die_in_next_move(worker.core.runner.eplb, rank)
            return
        if count[0] == at:
            stderr_line(f"moeserve: testing hook {TEST_HANG_ENV}: rank {rank} {mode} at step {at}")
            if mode == "spin":
                while True:
                    pass
            if mode == "block":
                threading.Event().wait()
            if mode == "crawl":
                _crawl(float(parts[3]))
        elif count[0] == at + 1 and mode == "crawl":
            _crawl(0.0)

    return before_step


def _die_in_next_move(eplb, rank: int) -> None:
    """Testing only: the next EPLB move this rank starts kills it after its first layer's transfers."""
    import signal

    if eplb is None:
        raise RuntimeError(f"{TEST_HANG_ENV} die-in-move needs --enable-eplb")
    start = eplb._start_move

    def start_and_die(*a, **kw):
        move = start(*a, **kw)
        stderr_line(f"moeserve: testing hook {TEST_HANG_ENV}: rank {rank} dies inside EPLB rebalance "
                    f"{eplb.num_rebalances + 1}'s weight move")
        os.kill(os.getpid(), signal.SIGKILL)
        return move

    eplb._start_move = start_and_die


def _crawl(seconds: float) -> None:
    """Testing only: each collective of GroupCoordinator sleeps `seconds` first (0: undo)."""
    from moeserve.distributed.comm import GroupCoordinator

    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    if not hasattr(GroupCoordinator, "_crawl_saved"):
        GroupCoordinator._crawl_saved = {n: getattr(GroupCoordinator, n) for n in names}
    saved = GroupCoordinator._crawl_saved
    for n in names:
        if seconds <= 0:
            setattr(GroupCoordinator, n, saved[n])
            continue

        def slow(self, *a, _f=saved[n], **kw):
            time.sleep(seconds)
            return _f(self, *a, **kw)

        setattr(GroupCoordinator, n, slow)


def survivor_parallel(parallel: ParallelConfig, num_experts: int, alive: int, master_port: int) -> ParallelConfig:
    """The layout of `alive` survivors: one DP rank fewer per loss, redundant slots topped up so that the
    experts spread evenly (8 experts over 3 ranks: one replica more), options that need 2+ ranks off for 1."""
    redundant = parallel.num_redundant_experts
    redundant += -(num_experts + redundant) % alive
    many = alive > 1
    return dataclasses.replace(
        parallel, data_parallel_size=alive, master_port=master_port, num_redundant_experts=redundant,
        moe_node_size=None, enable_eplb=parallel.enable_eplb and many, enable_elastic_ep=many,
        elastic_ep_replace=parallel.elastic_ep_replace and many,
        elastic_ep_host_copy=parallel.elastic_ep_host_copy and many,  # a lone survivor reads base_config's
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

def ride_through(worker, joining: bool = False) -> None:
    """Run the rank's loop (dp_worker.RankWorker); when a step fails, leave the epoch, wait for the front end's
    re-formation and serve in the new one. Returns when the front end shuts the engine down. joining: a
    replacement rank (--elastic-ep-replace), in no epoch yet: it starts by waiting for one."""
    from moeserve.protocol import RankReport

    while True:
        reform = None
        if not joining:
            try:
                worker.run()
                return
            except EpochOver as e:  # the front end saw the loss first; this rank's collective had not failed yet
                reform = e.reform
            except Exception as e:  # noqa: BLE001 - a peer died mid-step (or its collective timed out)
                _left(worker, e, RankReport)
        while True:
            if not joining:
                _leave_epoch(worker)
            joining = False
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
    stderr_line(f"moeserve: {msg}")
    worker.report(report_cls(worker.info.dp_rank, error=msg))


def _leave_epoch(worker) -> None:
    """Close the epoch's connections, roll the engine core back to its last finished step (or drop it where it
    cannot be kept: can_keep), then drop the process groups. Only the dead rank's
    neighbours in a ring all-gather see its sockets close; the other survivors wait on live ones, so every
    survivor that leaves shuts its connections down first: each blocked peer raises at once (waiting for
    the groups' last references to go would not do: a compiled graph or an async work may keep one)."""
    import torch

    from moeserve.distributed.parallel_state import destroy_distributed

    _shut_connections(worker.front_end_port)
    worker.between_steps = None  # the epoch's graphs still to compile (elastic_graphs.py) go with it
    if worker.core is not None and can_keep(worker.core):
        roll_back(worker.core)
        stats = getattr(worker, "stats", None)
        if stats is not None and stats.num_steps:  # the graph steps the front end saw: not the interrupted one
            worker.core.runner.graph_steps_carried = stats.num_graph_steps
    else:
        worker.core = None
    worker.world = worker.tp = None
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


def _gather_survivors(worker, reform, store) -> None:
    """Wait until every survivor of the epoch has checked in at the front end's store, reading the front
    end meanwhile: a newer re-formation (another rank died while re-forming) or a shutdown ends the wait at
    once, where a process-group rendezvous would wait for the dead rank until --distributed-timeout."""

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
    # the engine core is re-placed (or built) eagerly: a replacement's build must not trace its graphs before it
    # received its experts (the survivors' transfers come first); the graphs come last (_late_graphs)
    served = dataclasses.replace(base, parallel=parallel)
    config = dataclasses.replace(served, model=dataclasses.replace(base.model, enforce_eager=True))
    worker.epoch = reform.epoch
    if worker.beacon is not None:
        worker.beacon.new_epoch(reform.epoch)
    init_distributed(parallel, reform.rank, reform.init_method, store=store)
    at_join = getattr(worker.before_step, "at_join", None)  # testing only (MOESERVE_TEST_ELASTIC_HANG)
    if at_join is not None:
        at_join()
    info = RankInfo.of(reform.rank, parallel)
    maps, peers = vote_maps(worker, parallel)  # a collective of the new epoch: every rank, joiners too
    kept_core = worker.core is not None
    if kept_core:
        kept, got, hosted, read = keep_core(worker, config, info, maps, peers=peers, ready=False)
        how = (f"kept its engine core ({kept} expert slots kept, {got} received from peers, {hosted} from the host "
               f"copy, {read} checkpoint tensors read)")
    else:  # a replacement: its experts from the survivors and the host copy where they have them
        from moeserve.engine.elastic_replace import build_core

        core, got, hosted, read = build_core(worker, config, info, maps, peers)
        worker.start(config, info, core, built=True, ready=False)
        whose = " for the others' expert map" if maps is not None else ""
        how = (f"built its engine core{whose} ({got} expert slots received from peers, {hosted} from the host "
               f"copy, {read} checkpoint expert tensors read)")
    if _late_graphs(worker, served, started):
        how += ", its decode graphs to be compiled between steps"
    worker.ready(built=not kept_core)
    stderr_line(f"moeserve: pid {os.getpid()} joined epoch {reform.epoch} as rank {reform.rank} of "
                f"{reform.world_size} in {time.monotonic() - started:.1f} s and {how}")


def _late_graphs(worker, served, started: float) -> bool:
    """The re-formation's last step: the served config (not eager) on the kept or built core, and, unless the
    engine decodes eagerly (--enforce-eager), the epoch's decode graphs with no bucket compiled yet
    (elastic_graphs.LateGraphs): the rank reports ready and serves eagerly at once, and every rank of the epoch
    compiles the graphs between steps, one bucket at a time, at the same rounds (elastic_graphs.between_steps;
    each MoE layer's graph holds its dispatch collectives). Returns whether graphs will come."""
    from moeserve.engine.elastic_graphs import install

    core = worker.core
    core.runner.config = core.config = worker.config = served
    return install(worker, started)
