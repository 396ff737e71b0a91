"""One rank process of a multi-rank engine: an EngineCore stepping in lockstep with all other ranks.

Lifecycle: rank_main() joins the process group -> builds its EngineCore (its shard of the model) -> the
TP leader (tp_rank 0) of each DP rank connects to the front end over ZMQ and reports ready -> loop:
  1. the leader drains RankCommands (msgspec) from the front end; with T > 1 it broadcasts them to its TP
     peers, so all TP ranks of a DP rank run identical schedulers;
  2. a tiny all-gather over all ranks: [has work, shutdown, prefill demand, decodes]; nobody has work ->
     wait for commands; anyone shuts down -> all leave together;
  3. every rank steps (a rank with no work runs an empty forward: the MoE layers are collectives), with a
     token budget that evens prefill tokens across DP ranks (prefill bucketing);
  4. the leader sends the step's outputs and stats back.
A failed collective (a dead peer, a timeout) ends the rank with a RankReport naming it; with
--enable-elastic-ep the rank instead waits for the front end to re-form the survivors (engine/elastic.py).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import msgspec
import torch
import zmq

from moeserve.config import EngineConfig
from moeserve.distributed import comm
from moeserve.distributed.parallel_state import (RankInfo, destroy_distributed, get_tp_group, get_world_group,
                                                 init_distributed)
from moeserve.engine.dp_balance import prefill_balanced_budget
from moeserve.engine.elastic import EpochOver, compiling  # there, not here: this module also runs as __main__
from moeserve.engine.engine_core import EngineCore
from moeserve.engine.request import RequestStatus
from moeserve.protocol import SLO_FIELDS, SPEC_FIELDS, EngineStats, RankCommand, RankReport
from moeserve.stderr_line import stderr_line

IDLE_POLL_MS = 10  # how long an idle leader waits for commands before the next agreement round


class RankWorker:
    def __init__(self, config: EngineConfig, info: RankInfo, zmq_addr: str, parent_pid: int | None,
                 join: bool = False) -> None:
        """join (--elastic-ep-replace): a replacement rank; it builds nothing here, says it is up and then
        waits for the front end's next epoch (elastic.ride_through)."""
        self.parent_pid = parent_pid
        self.front_end_port = int(zmq_addr.rsplit(":", 1)[1])  # --enable-elastic-ep keeps this connection
        self.base_config = config  # --enable-elastic-ep: survivors derive each epoch's layout from it
        self.epoch = 0  # --enable-elastic-ep: the process-group epoch this rank serves in
        self.sock = None
        if info.tp_rank == 0:
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            # the identity stays this process's first DP rank for its life: the front end addresses it so
            self.sock.setsockopt(zmq.IDENTITY, f"dp{info.dp_rank}".encode())
            self.sock.setsockopt(zmq.LINGER, 1000)
            self.sock.connect(zmq_addr)
        self.decoder = msgspec.msgpack.Decoder(RankCommand)  # from the front end
        self.list_decoder = msgspec.msgpack.Decoder(list[RankCommand])  # from the TP leader
        self.arch = None
        self.beacon = None  # --enable-elastic-ep: publishes this rank's progress for the front end's hang check
        self.before_step = None
        self.between_steps = None  # elastic EP: a re-formed epoch compiles its decode graphs (elastic_graphs.py)
        if config.parallel.enable_elastic_ep:  # TP 1: every rank is its DP rank's leader
            from moeserve.engine.elastic import BOARD_SLOTS, ProgressBeacon, ProgressBoard, test_hang_hook
            try:
                board = ProgressBoard(ProgressBoard.path_for(self.front_end_port), BOARD_SLOTS)
            except (OSError, ValueError) as e:  # no hang check then; the rest of elastic EP works
                stderr_line(f"moeserve: {info.describe()}: no progress board ({e}): a hung rank is not detected")
            else:
                self.beacon = ProgressBeacon(board, info.rank)
                self.beacon.start()
            self.before_step = test_hang_hook(info.rank)  # testing only (MOESERVE_TEST_ELASTIC_HANG)
        if join:
            from moeserve.arch import DeepseekArch
            from moeserve.engine.elastic import JOINING_EPOCH

            self.config, self.info, self.leader = config, info, True
            self.core = self.world = self.tp = None
            self.arch = DeepseekArch.from_pretrained(config.model.model)
            self.epoch = JOINING_EPOCH  # its reports say "a replacement, up and waiting"
            before_hello = getattr(self.before_step, "before_hello", None)  # testing only
            if before_hello is not None:
                before_hello()
            self.report(RankReport(info.dp_rank, ready=True))
            return
        self.start(config, info)

    def start(self, config: EngineConfig, info: RankInfo, core: EngineCore | None = None,
              built: bool = False, ready: bool = True) -> None:
        """Build the engine core over the process groups init_distributed() formed (or serve on with `core`,
        one elastic EP re-placed for them: engine/elastic.py; built: one elastic EP built for them,
        engine/elastic_replace.py), then report ready (not with ready=False: elastic EP reports it after
        compiling the epoch's decode graphs)."""
        self.config, self.info = config, info
        self.world, self.tp = get_world_group(), get_tp_group()
        self.leader = info.tp_rank == 0
        if core is None:
            with compiling(self):  # its decode graphs: elastic EP's hang check leaves it alone meanwhile
                core = EngineCore(config, self.arch)
            built = True
        self.core = core
        self.arch = self.core.arch
        if built and self.base_config.parallel.elastic_ep_host_copy:  # before ready: whole when it counts
            from moeserve.engine import elastic_host_copy
            from moeserve.engine.elastic_placement import expert_roots, slot_params

            elastic_host_copy.write(self, expert_roots(self.core.runner), slot_params)
        self.stats = EngineStats()
        if ready:
            self.ready(built)

    def ready(self, built: bool) -> None:
        """Report ready to the front end; a survivor that kept its core (not built) lists its requests."""
        if self.leader:
            kept = ({rid: r.num_output_tokens for rid, r in self.core.scheduler.requests.items()}
                    if not built else {})  # elastic EP: a survivor serves on with these
            self.report(RankReport(self.info.dp_rank, ready=True, num_kv_blocks=self.core.num_kv_blocks, kept=kept))

    def report(self, msg: RankReport) -> None:
        msg.epoch = self.epoch
        self.sock.send(msgspec.msgpack.encode(msg))

    def front_end_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def close(self) -> None:
        if self.core is not None:
            self.core.flush_stats()
        if self.sock is not None:
            self.sock.close()

    def run(self) -> None:
        anyone_busy = False
        while True:
            cmds = self._commands(wait=not anyone_busy)
            shutdown = self._apply(cmds)
            self.core.poll_kv_transfer()  # PD: local, no collective; a pull whose KV arrived is work from here
            s = self.core.scheduler
            mine = torch.tensor([[int(self.core.has_schedulable()), int(shutdown), s.prefill_demand(),
                                  s.num_decodes()]], dtype=torch.long)
            flags = self.world.all_gather(mine, kind="step_sync")  # [W, 4]
            if flags[:, 1].any():
                return
            if self.between_steps is not None:  # every rank of the epoch at the same round (elastic_graphs.py)
                self.between_steps(self, flags)
            anyone_busy = bool(flags[:, 0].any())
            if anyone_busy:
                self._step(flags)
            elif self.leader and any(c.aborts for c in cmds):
                self._report([])  # no step follows: the front end must still see the freed slots

    def _step(self, flags: torch.Tensor) -> None:
        p = self.config.parallel
        # flags [W, 4] per rank (has work, shutdown, prefill demand, decodes); ranks are DP-major and TP
        # peers repeat their DP rank's row, so every T-th row is one DP rank
        per_dp = flags[::p.tensor_parallel_size]
        budget = prefill_balanced_budget(per_dp[:, 2].tolist(), int(per_dp[:, 3].sum()),
                                         self.config.scheduler.max_num_batched_tokens,
                                         self.core.scheduler.num_decode_tokens())  # MTP drafts included
        idle = not self.core.has_schedulable()
        if self.before_step is not None:
            self.before_step(self)
        outputs = self.core.step(budget, lockstep=True)
        step = comm.STATS.reset()
        st = self.stats
        st.num_steps += 1
        st.num_dummy_steps += int(idle)
        for k, v in step.bytes.items():
            st.comm_bytes[k] = st.comm_bytes.get(k, 0) + v
        for k, v in step.seconds.items():
            st.phase_seconds[k] = st.phase_seconds.get(k, 0.0) + v
        if self.leader:  # every step, so idle ranks' stats (their empty steps) are seen too
            self._report(outputs)
        # --enable-eplb: a rebalance is a collective step boundary; after the report, so that a peer lost in it
        # (elastic EP) finds the front end knowing every token this step made (the survivor keeps its requests)
        self.core.runner.lockstep_step_done()

    def _report(self, outputs) -> None:
        """The leader sends this DP rank's outputs with its current load."""
        st, s = self.stats, self.core.stats()
        st.num_running, st.num_waiting, st.kv_cache_usage = s.num_running, s.num_waiting, s.kv_cache_usage
        st.num_preemptions, st.outstanding_tokens = s.num_preemptions, s.outstanding_tokens
        st.prefix_cache_queries, st.prefix_cache_hits = s.prefix_cache_queries, s.prefix_cache_hits
        st.num_graph_steps = s.num_graph_steps
        eplb = self.core.runner.eplb
        if eplb is not None:
            st.eplb_rebalances, st.eplb_experts_moved = eplb.num_rebalances, eplb.experts_moved
        for f in SPEC_FIELDS + SLO_FIELDS + ("step_time_error", "slo_ttft_estimate_s", "slo_prefill_estimate_s"):
            setattr(st, f, getattr(s, f))
        self.report(RankReport(self.info.dp_rank, outputs, st))

    def _commands(self, wait: bool) -> list[RankCommand]:
        """This step's commands: read by the leader, identical on every TP rank of the DP rank."""
        cmds: list[RankCommand] = []
        if self.leader:
            if self.front_end_gone():
                raise RuntimeError("the front-end process exited")
            timeout = IDLE_POLL_MS if wait and not self.core.has_schedulable() else 0
            while self.sock.poll(timeout):
                cmds.append(self.decoder.decode(self.sock.recv()))
                timeout = 0
        if self.tp.world_size > 1:
            payload = msgspec.msgpack.encode(cmds) if self.leader else None
            cmds = self.list_decoder.decode(self.tp.broadcast_bytes(payload))
        return cmds

    def _apply(self, cmds: list[RankCommand]) -> bool:
        """Apply commands in order; True if one asks to shut down."""
        for cmd in cmds:
            if cmd.reform is not None:
                raise EpochOver(cmd.reform)
            for req in cmd.requests:
                self.core.add_request(req)
            if cmd.aborts:
                self.core.abort_requests(cmd.aborts, RequestStatus(cmd.abort_status))
            if cmd.reset_prefix_cache:
                self.core.reset_prefix_cache()
        return any(c.shutdown for c in cmds)


def rank_main(config_bytes: bytes, rank: int, init_method: str, zmq_addr: str, parent_pid: int | None,
              num_threads: int, own_process: bool = False, join: bool = False) -> None:
    """Entry point of a rank process (spawned by launch.py, or called per process under torchrun)."""
    torch.set_num_threads(num_threads)
    if own_process:  # requests bring their compiled automata (structured/params.py): none compiles here
        from moeserve.structured.params import compile_in_this_process
        compile_in_this_process(False)
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    info = RankInfo.of(rank, config.parallel)
    worker = None
    try:
        if not join:  # a replacement (--elastic-ep-replace) joins the front end's next epoch instead
            init_distributed(config.parallel, rank, init_method)
        worker = RankWorker(config, info, zmq_addr, parent_pid, join=join)
        if config.parallel.enable_elastic_ep:  # a peer's loss: re-form with the survivors, go on serving
            from moeserve.engine.elastic import ride_through
            ride_through(worker, joining=join)
        else:
            worker.run()
    except BaseException as e:  # noqa: BLE001 - report any failure, then exit non-zero
        msg = f"{info.describe()} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        stderr_line(f"moeserve: {msg}\n{traceback.format_exc()}")
        if worker is not None and worker.sock is not None:
            worker.report(RankReport(info.dp_rank, error=msg))
            time.sleep(0.2)  # let ZMQ flush the report
        if own_process or threading.current_thread() is threading.main_thread():
            os._exit(1)  # skip process-group teardown: peers may be gone and it could block
        return  # torchrun rank 0's thread: the front end in this process raises from the report
    worker.close()
    if own_process:
        os._exit(0)  # a rank process: skip interpreter/process-group teardown, which can block on gone peers
    destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="one moeserve rank (started by moeserve.engine.launch)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--join", action="store_true", help="--elastic-ep-replace: join the running engine's next epoch")
    a = ap.parse_args(argv)
    # Started ahead of need by a standby engine core (launch.spawn_rank_processes): what the engine's build
    # imports is imported while waiting; torch._dynamo too, which nn.Embedding's initialisation on the meta
    # device pulls in (its normal_ is a torch._refs decomposition), ~2 s of CPU.
    import torch._dynamo  # noqa: F401
    start = sys.stdin.buffer.read()  # [init method, ZMQ address, EngineConfig] from LocalRanks
    if not start:  # the engine core that started it went away before it was needed
        os._exit(0)
    init_method, zmq_addr, config_bytes = msgspec.msgpack.decode(start)
    rank_main(config_bytes, a.rank, init_method, zmq_addr, a.parent_pid, a.threads, own_process=True, join=a.join)


if __name__ == "__main__":
    main()
