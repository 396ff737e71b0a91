"""The front end of a multi-rank engine, with EngineCore's interface (add_request, abort_requests, step,
has_unfinished, stats), so the offline LLM and the server's engine-core process host either.

Lifecycle: __init__ launches the local ranks (launch.py) and waits until every DP rank's TP leader has
loaded its shard and reported ready -> add_request sends each request to the DP rank with the least
outstanding work (prompt tokens + tokens still to generate of its unfinished requests) -> step() returns
the outputs the ranks reported since the last call -> shutdown() tells all ranks to stop together.
If a rank dies or reports a failure, step() raises EngineDeadError naming the rank; the other ranks are
stopped (their collectives fail, or they are killed after the timeout). With --enable-elastic-ep a lost rank
is dropped instead: the survivors re-form under a new epoch and keep the requests they ran; every other
unfinished request (the lost rank's) is re-queued on them with its tokens so far (engine/elastic.py has the
lifecycle).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
import time
import weakref

import msgspec
import zmq

from moeserve import netif
from moeserve.config import EngineConfig
from moeserve.engine import elastic_host_copy
from moeserve.engine.dp_balance import LeastLoadedRouter, slo_ranked_ttft
from moeserve.engine.elastic import BOARD_SLOTS, JOINING_EPOCH, ProgressBoard
from moeserve.engine.elastic_front import ElasticFront, _exit_text
from moeserve.engine.launch import LocalRanks, TorchrunEnv, resolve_endpoints
from moeserve.engine.request import RequestStatus
from moeserve.protocol import (EngineCoreOutput, EngineCoreRequest, EngineStats, RankCommand, RankReport,
                               add_slo_stats, add_spec_stats)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a big checkpoint on every rank takes a while


class EngineDeadError(RuntimeError):
    """A rank process died or failed; the message names it."""


class DPEngineClient(ElasticFront):  # ElasticFront: the re-formation bookkeeping (elastic_front.py)
    def __init__(self, config: EngineConfig, torchrun: TorchrunEnv | None = None, prespawned=None) -> None:
        parallel, init_method, zmq_addr = resolve_endpoints(config.parallel, torchrun)
        # every epoch's rendezvous store, served here (the first listening before any rank starts); older ones
        # stay (a survivor still checking in at one would wait out its timeout on a closed store)
        self._epoch_stores: list = []
        if torchrun is None:
            from moeserve.distributed.parallel_state import host_rendezvous

            self._epoch_stores.append(host_rendezvous(parallel.master_addr, parallel.master_port or 0,
                                                      datetime.timedelta(seconds=parallel.distributed_timeout)))
            parallel = dataclasses.replace(parallel, master_port=self._epoch_stores[0].port)
            init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
        self.config = dataclasses.replace(config, parallel=parallel)  # keeps quant, speculative, ...
        self.dp_size, self.tp_size = parallel.data_parallel_size, parallel.tensor_parallel_size
        self.timeout = parallel.distributed_timeout
        self.stall_timeout = parallel.stall_timeout
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host, port = zmq_addr.removeprefix("tcp://").rsplit(":", 1)
        # the address the ranks are told (--master-addr; 127.0.0.1 by default), not every interface; port 0:
        # one the OS picks now
        bind_host = "*" if netif.is_wildcard(host) else netif.resolve(host)
        self.sock.bind(f"tcp://{bind_host}:{'*' if port == '0' else port}")
        port = self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        zmq_addr = f"tcp://{host}:{port}"
        # --enable-elastic-ep: each rank publishes the collectives it has begun there (the hang check)
        self.board = None
        if parallel.enable_elastic_ep and torchrun is None:
            try:
                self.board = ProgressBoard(ProgressBoard.path_for(int(port)), BOARD_SLOTS, create=True)
            except OSError as e:  # the rest of elastic EP works without it
                logger.warning("--enable-elastic-ep: no progress board (%s): a hung rank is not detected", e)
        self.host_copy = None  # --elastic-ep-host-copy: the ranks' expert files (elastic_host_copy.py)
        if parallel.enable_elastic_ep and parallel.elastic_ep_host_copy and torchrun is None:
            self.host_copy = elastic_host_copy.folder(int(port))
            shutil.rmtree(self.host_copy, ignore_errors=True)  # a former engine's on this port
        self.hang_timeout = parallel.elastic_ep_hang_timeout
        self._beats: dict[int, tuple[int, int]] | None = None  # the last beats read, and since when unchanged
        self._beats_at = time.monotonic()
        self.hung_killed: list[int] = []  # rank processes the hang check killed
        try:
            self.ranks = LocalRanks(self.config, init_method, zmq_addr, torchrun, prespawned)
        except BaseException:
            if self.board is not None:
                self.board.unlink()
            if self.host_copy is not None:
                shutil.rmtree(self.host_copy, ignore_errors=True)
            raise
        # the rank process serving each DP rank (its ZMQ identity is dp<first rank>): elastic EP drops lost ones
        self.slots: list[int] = list(range(self.dp_size))
        # --elastic-ep-replace: replacement rank processes started and not yet in an epoch -> up (said so)
        self.joining: dict[int, float | None] = {}  # slot -> when it said it is up (None: starting)
        self._next_slot = parallel.world_size
        self._unreplaced = 0  # ranks lost whose replacement has not been started yet
        self._served: set[int] = set(range(self.dp_size))  # rank processes that were ready in an epoch
        self._spare: int | None = None  # the spare rank process started ahead (LocalRanks.spawn_spare)
        # the spare sent on into the current re-formation: its RankReform goes out once it says it is up
        self._awaiting: set[int] = set()
        self._epoch_init = ""  # the current epoch's rendezvous
        self._finalizer = weakref.finalize(self, _stop, self.sock, self.ranks, self.slots, self.board, self.joining,
                                           self._awaiting, self.host_copy)
        self.decoder = msgspec.msgpack.Decoder(RankReport)
        self.dead: str | None = None
        self.num_kv_blocks = 0
        self._last_progress = time.monotonic()
        self._reset_ranks()
        # --enable-elastic-ep: every unfinished request with the tokens seen so far (re-queued after a loss)
        self.epoch = 0
        self.lost: set[int] = set()  # rank processes dropped
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self._owners: dict[str, int] = {}  # at a loss: request id -> the rank process it ran on
        self._first_cached: dict[str, int] = {}  # request id -> prompt tokens cached at its first admission
        self._late: list[EngineCoreOutput] = []  # outputs of older epochs read after a loss (_late_outputs)
        self.recovery: dict | None = None  # the re-formation in progress: epoch, waiting DP ranks, start
        self.elastic_stats = EngineStats()  # the elastic_* counters
        self.elastic = False  # a rank lost while starting fails the start: nothing runs yet
        self._wait_ready()
        self.replace = parallel.elastic_ep_replace
        if self.board is not None and not self.replace:
            self.board.unlink()  # every rank has mapped it (replacements map it later: unlinked at the end then)
        if self.replace:
            self._spawn_spare()
        self.elastic = parallel.enable_elastic_ep

    def _reset_ranks(self) -> None:
        """Per-DP-rank state for the current DP size (at start, and after a re-formation)."""
        cache = self.config.cache  # with prefix caching the router prefers the rank that has the prompt's prefix
        self.router = LeastLoadedRouter(self.dp_size, cache.block_size if cache.enable_prefix_caching else None)
        self.rank_stats: list[EngineStats] = [EngineStats() for _ in range(self.dp_size)]
        self.sent_since_report = [0] * self.dp_size  # requests routed to a rank after its last report
        self._last_report = [time.monotonic()] * self.dp_size  # per DP rank, for the stall check
        self._busy_since = time.monotonic()

    # ---- EngineCore interface ----------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self._check_alive()  # a stopped engine answers EngineDeadError, not a closed-socket error
        if self.elastic:
            self.requests[req.request_id] = (req, [])
            if self.recovery is not None:
                return  # sent with the re-queued ones once the survivors are ready
        self._route(req)

    def _route(self, req: EngineCoreRequest, rank: int | None = None) -> None:
        """rank: the DP rank to send it to (elastic EP's re-queue: where its KV is cached), else the router's."""
        max_new = req.sampling_params.max_tokens or self.config.scheduler.max_model_len
        max_new = max(1, max_new - len(req.output_token_ids))
        prompt = req.prompt_token_ids + req.output_token_ids if req.output_token_ids else req.prompt_token_ids
        if not self.router:
            self._busy_since = time.monotonic()
        ttft = None
        if req.slo_ttft_ms is not None or self.config.scheduler.slo_ttft_ms is not None:
            st = self.rank_stats
            ttft = slo_ranked_ttft([s.slo_ttft_estimate_s for s in st], [s.slo_prefill_estimate_s for s in st],
                                   self.sent_since_report)
        dp = self.router.assign(req.request_id, len(prompt), max_new, prompt, ttft, rank=rank)
        self.sent_since_report[dp] += 1
        self._send(dp, RankCommand(requests=[req]))

    def abort_requests(self, request_ids: list[str], reason: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        by_rank: dict[int, list[str]] = {}
        unknown = []
        for rid in request_ids:
            self.requests.pop(rid, None)
            self._first_cached.pop(rid, None)
            if rid in self.router:
                by_rank.setdefault(self.router.forget(rid), []).append(rid)
            else:
                unknown.append(rid)
        kvt = self.config.kv_transfer
        if unknown and kvt is not None and kvt.produces:
            # A finished PD prefill request may still hold KV on its rank (the router forgot it at the
            # finish): every rank is asked, and the one holding it frees it (EngineCore.abort_requests).
            for dp in range(self.dp_size):
                by_rank.setdefault(dp, []).extend(unknown)
        if self.dead:  # nothing runs any more: forgetting them is all there is to do
            return
        for dp, ids in by_rank.items():
            self._send(dp, RankCommand(aborts=ids, abort_status=reason.value))

    def has_unfinished(self) -> bool:
        return bool(self.requests) if self.elastic else bool(self.router)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.rank_stats)

    def step(self, poll_s: float = 0.05) -> list[EngineCoreOutput]:
        """Outputs reported since the last call (waits up to poll_s for the first)."""
        self._check_alive()
        if self.recovery is not None:
            self._poll_recovery(poll_s)
            return self._take_late()
        if self._joiners_due():  # the replacements that are up join the next epoch
            self._start_recovery()
            return self._take_late()
        outputs: list[EngineCoreOutput] = self._take_late()
        timeout_ms = int(poll_s * 1000)
        heard = False
        while self.sock.poll(timeout_ms):
            timeout_ms, heard = 0, True
            report = self._recv()
            if report is None:  # of an older epoch, or a loss that started a re-formation
                if self.recovery is not None:
                    return outputs
                continue
            self._take_report(report, outputs)
        if heard or not self.router:  # every step reports, so a long chunked prefill is progress too
            self._last_progress = time.monotonic()
        elif (silent := time.monotonic() - self._last_progress) > self.stall_timeout and self.ranks.stopped():
            # a stopped rank (SIGSTOP) never resumes by itself: dead now, not after the gloo timeout; a rank
            # that is merely slow (a long step) is not stopped, and only --distributed-timeout ends that
            r, t = self.ranks.stopped()[0], self.tp_size
            if self.elastic:  # dropped like a dead rank: the next _check_alive re-forms the others
                logger.warning("rank %d is stopped and no rank progressed for %.1f s: killing it", r, silent)
                self.ranks.kill_rank(r)
                return outputs
            self.ranks.kill()  # the others wait in a collective with it: no clean exit to wait for
            self._fail(f"rank {r} (dp {r // t}, tp {r % t}) is stopped (SIGSTOP or a debugger) and no rank "
                       f"progressed for {silent:.1f} s (--engine-stall-timeout {self.stall_timeout:g}); "
                       "the engine stopped")
        elif silent > self.timeout:
            self._fail(f"no report from any rank for {self.timeout:.0f} s (--distributed-timeout) while "
                       f"{len(self.router)} request(s) are unfinished")
        return outputs

    def _take_report(self, report: RankReport, outputs: list[EngineCoreOutput]) -> None:
        """A step report of the current epoch: its outputs counted as seen and appended to outputs."""
        self._last_report[report.dp_rank] = time.monotonic()
        self.rank_stats[report.dp_rank] = report.stats or self.rank_stats[report.dp_rank]
        if report.stats:
            self.sent_since_report[report.dp_rank] = 0
        for out in report.outputs:
            if out.request_id not in self.router:
                continue  # aborted here already
            self.router.progress(out.request_id, len(out.new_token_ids))
            if self.elastic and out.request_id in self.requests:
                self.requests[out.request_id][1].extend(out.new_token_ids)
                # the prompt's cache hits are those of its first admission: a re-queued request's hits on
                # its survivor's prefix cache cover the recompute, not the prompt (as a resume's: engine_client)
                out.num_cached_tokens = self._first_cached.setdefault(out.request_id, out.num_cached_tokens)
            if out.finish_reason is not None:
                self.router.forget(out.request_id)
                self.requests.pop(out.request_id, None)
                self._first_cached.pop(out.request_id, None)
            outputs.append(out)

    def stats(self) -> EngineStats:
        """Sums over DP ranks (comm bytes and phase seconds of the TP leaders). Also the liveness check of
        an idle engine (the server's heartbeat calls it): raises EngineDeadError when a rank is gone."""
        self._check_alive()
        if not self.router:  # idle: nobody calls step(), so read the reports ranks sent after aborts here
            self.step(poll_s=0)
        total = EngineStats()
        for s in self.rank_stats:
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.num_preemptions += s.num_preemptions
            total.prefix_cache_queries += s.prefix_cache_queries
            total.prefix_cache_hits += s.prefix_cache_hits
            total.eplb_rebalances = max(total.eplb_rebalances, s.eplb_rebalances)  # every rank runs each one
            total.eplb_experts_moved += s.eplb_experts_moved
            total.num_steps = max(total.num_steps, s.num_steps)
            total.num_dummy_steps += s.num_dummy_steps
            total.num_graph_steps += s.num_graph_steps
            total.kv_cache_usage = max(total.kv_cache_usage, s.kv_cache_usage)
            add_spec_stats(total, s)
            add_slo_stats(total, s)
            for k, v in s.comm_bytes.items():
                total.comm_bytes[k] = total.comm_bytes.get(k, 0) + v
            for k, v in s.phase_seconds.items():
                total.phase_seconds[k] = total.phase_seconds.get(k, 0.0) + v
        total.outstanding_tokens = sum(self.router.load)
        total.stalled_s = self.stalled_s()
        for f in ("elastic_ranks_lost", "elastic_ranks_replaced", "elastic_last_recovery_s", "elastic_recovery_s",
                  "elastic_requeued", "elastic_tokens_recomputed"):
            setattr(total, f, getattr(self.elastic_stats, f))
        if self.recovery is not None:  # re-forming is not a hang: the survivors report when ready
            total.num_waiting += len(self.requests)
        return total

    def stalled_s(self) -> float:
        """Seconds the quietest DP rank has not reported while requests are unfinished. With work anywhere
        every rank steps (lockstep) and reports each step, so a silent rank is a hung one (SIGSTOP, a stuck
        collective), long before --distributed-timeout declares it dead."""
        if not self.router or self.recovery is not None:
            return 0.0
        return max(0.0, time.monotonic() - max(self._busy_since, min(self._last_report)))

    def reset_prefix_cache(self) -> bool:
        """Every DP rank forgets its cached prefixes (with its next commands, before its next step)."""
        for dp in range(self.dp_size):
            self._send(dp, RankCommand(reset_prefix_cache=True))
        return True

    def flush_stats(self) -> None:
        """--expert-load-stats: each rank process writes its own file (periodically and when it stops)."""

    def shutdown(self) -> None:
        self._finalizer()

    # ---- internals ---------------------------------------------------------------------------------
    def _send(self, dp: int, cmd: RankCommand) -> None:
        self.sock.send_multipart([f"dp{self.slots[dp]}".encode(), msgspec.msgpack.encode(cmd)])

    def _recv(self) -> RankReport | None:
        """The next report; None for one of an older epoch, or an error that began a re-formation."""
        identity, payload = self.sock.recv_multipart()
        report = self.decoder.decode(payload)
        if report.epoch == JOINING_EPOCH:
            self._joiner_report(report)
            return None
        if report.epoch != self.epoch:  # elastic EP: sent before the survivors re-formed
            if int(identity[2:]) in self.slots and report.outputs:
                self._late_outputs(report.outputs)
            return None
        if report.error and self.elastic:
            # a survivor left its step: a rank died (seen here within moments) or the engine is broken
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not self._newly_dead():
                time.sleep(0.05)
            if self._newly_dead():
                self._check_alive()  # starts the re-formation
                return None
        if report.error:
            # A rank whose collective failed usually reports before the dead peer is reaped: give the
            # cause a moment to show, and name it first.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not any(c < 0 for c in self.ranks.dead().values()):
                time.sleep(0.05)
            cause = self._dead_rank_text()
            self._fail(f"{cause} (then {report.error})" if cause else report.error)
        return report

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.dp_size:
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(f"DP ranks {sorted(set(range(self.dp_size)) - ready)} did not start within "
                           f"{STARTUP_TIMEOUT_S:.0f} s")
            if self.sock.poll(100):
                report = self._recv()
                if report is None:
                    continue
                ready.add(report.dp_rank)
                self.num_kv_blocks = report.num_kv_blocks  # per DP rank (all ranks size their pool alike)

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.elastic:
            self._check_hung()
            self._check_joiners()
        if self.elastic and self._newly_dead() and len(self.slots) > len(self._newly_dead()):
            self._start_recovery()
            return
        cause = self._dead_rank_text()
        if cause:
            self._fail(cause)

    def _newly_dead(self) -> dict[int, int]:
        return {r: c for r, c in self.ranks.dead().items() if r not in self.lost}

    def _dead_rank_text(self) -> str | None:
        dead = self._newly_dead()
        if not dead:
            return None
        # A rank killed by a signal is the cause; ranks that exited 1 failed in a collective after it.
        first = min(dead, key=lambda r: (dead[r] >= 0, r))
        t = self.tp_size
        return f"rank {first} (dp {first // t}, tp {first % t}) {_exit_text(dead[first])}; the engine stopped"

    def _fail(self, message: str) -> None:
        self.dead = message
        self._finalizer()
        raise EngineDeadError(message)


def _stop(sock, ranks: LocalRanks, slots: list[int], board=None, joining: dict | None = None,
          awaiting: set | None = None, host_copy: str | None = None) -> None:
    """Ask every DP rank to shut down, then make sure the local processes are gone."""
    if board is not None:
        board.unlink()  # a start that failed before every rank was ready, or --elastic-ep-replace
    for slot in [*(joining or ()), *(awaiting or ())]:  # replacements in no epoch yet hold nothing: no clean
        ranks.kill_rank(slot)  # exit to wait for
    try:
        for slot in slots:
            sock.send_multipart([f"dp{slot}".encode(), msgspec.msgpack.encode(RankCommand(shutdown=True))],
                                flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    ranks.join(timeout=10)
    ranks.kill()
    sock.close()
    if host_copy is not None:  # after the ranks: none writes there any more
        shutil.rmtree(host_copy, ignore_errors=True)
