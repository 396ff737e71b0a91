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
import logging
import signal
import time
import weakref

import msgspec
import zmq

from moeserve import netif
from moeserve.config import EngineConfig
from moeserve.engine.dp_balance import LeastLoadedRouter, slo_ranked_ttft
from moeserve.engine.elastic import BOARD_SLOTS, JOINING_EPOCH, ProgressBoard, epoch_store, hung_ranks
from moeserve.engine.launch import LocalRanks, TorchrunEnv, free_port, resolve_endpoints
from moeserve.engine.request import RequestStatus
from moeserve.protocol import (EngineCoreOutput, EngineCoreRequest, EngineStats, RankCommand, RankReform,
                               RankReport, add_slo_stats, add_spec_stats)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a big checkpoint on every rank takes a while
JOIN_GRACE_S = 10.0  # --elastic-ep-replace: a replacement that is up waits at most this long for another


class EngineDeadError(RuntimeError):
    """A rank process died or failed; the message names it."""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class DPEngineClient:
    def __init__(self, config: EngineConfig, torchrun: TorchrunEnv | None = None, prespawned=None) -> None:
        parallel, init_method, zmq_addr = resolve_endpoints(config.parallel, torchrun)
        self.config = dataclasses.replace(config, parallel=parallel)  # keeps quant, speculative, ...
        self.dp_size, self.tp_size = parallel.data_parallel_size, parallel.tensor_parallel_size
        self.timeout = parallel.distributed_timeout
        self.stall_timeout = parallel.stall_timeout
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host, port = zmq_addr.removeprefix("tcp://").rsplit(":", 1)
        # the address the ranks were told (--master-addr; 127.0.0.1 by default), not every interface
        self.sock.bind(f"tcp://{'*' if netif.is_wildcard(host) else netif.resolve(host)}:{port}")
        # --enable-elastic-ep: each rank publishes the collectives it has begun there (the hang check)
        self.board = None
        if parallel.enable_elastic_ep and torchrun is None:
            try:
                self.board = ProgressBoard(ProgressBoard.path_for(int(port)), BOARD_SLOTS, create=True)
            except OSError as e:  # the rest of elastic EP works without it
                logger.warning("--enable-elastic-ep: no progress board (%s): a hung rank is not detected", e)
        self.hang_timeout = parallel.elastic_ep_hang_timeout
        self._beats: dict[int, tuple[int, int]] | None = None  # the last beats read, and since when unchanged
        self._beats_at = time.monotonic()
        self.hung_killed: list[int] = []  # rank processes the hang check killed
        try:
            self.ranks = LocalRanks(self.config, init_method, zmq_addr, torchrun, prespawned)
        except BaseException:
            if self.board is not None:
                self.board.unlink()
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
                                           self._awaiting)
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
        self._epoch_stores: list = []
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

    def _late_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Tokens a survivor made in an older epoch, read after the loss was seen: the survivor keeps those
        requests with them (RankReport.kept), so they are the caller's (next step()) and count as seen. A lost
        rank's are dropped: its requests are re-queued with the tokens seen before."""
        for out in outputs:
            entry = self.requests.get(out.request_id)
            if entry is None:
                continue  # aborted here already
            entry[1].extend(out.new_token_ids)
            out.num_cached_tokens = self._first_cached.setdefault(out.request_id, out.num_cached_tokens)
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
                self._first_cached.pop(out.request_id, None)
            self._late.append(out)

    def _take_late(self) -> list[EngineCoreOutput]:
        late, self._late = self._late, []
        return late

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

    # ---- --enable-elastic-ep: re-form the survivors ---------------------------------------------------
    def _check_hung(self) -> None:
        """Kill a rank that holds its peers up: no rank has begun a collective for --elastic-ep-hang-timeout
        and this one's count lags the others' (they wait in a collective it never began). The caller then
        sees it dead and re-forms the others. A long step that makes progress begins collectives (each MoE
        layer has some), so it is not cut short; the timeout bounds one stretch of compute between two."""
        if self.board is None or self.recovery is not None:
            return
        now = time.monotonic()
        beats = {r: self.board.read(r) for r in self.slots}
        if beats != self._beats:
            self._beats, self._beats_at = beats, now
            return
        quiet = now - self._beats_at
        if quiet <= self.hang_timeout:
            return
        for r in hung_ranks(beats, self.epoch):
            if r in self.ranks.dead():
                continue
            logger.warning("rank %d began no collective for %.1f s while the other ranks waited on it "
                           "(--elastic-ep-hang-timeout %g): killing it", r, quiet, self.hang_timeout)
            self.ranks.kill_rank(r)
            self.hung_killed.append(r)
        self._beats = None

    def _joiner_report(self, report: RankReport) -> None:
        """--elastic-ep-replace: a replacement rank is up (it joins the next epoch), or failed before joining."""
        slot = report.dp_rank
        if slot in self._awaiting and not report.error:  # the spare of this re-formation: its place in it
            self._awaiting.discard(slot)
            dp = self.slots.index(slot)
            self._send(dp, RankCommand(reform=RankReform(self.epoch, dp, self.dp_size, self._epoch_init)))
            return
        if slot not in self.joining:
            return
        if report.error:
            logger.warning("replacement rank %d failed before joining: %s", slot, report.error)
            self.ranks.kill_rank(slot)
            self.lost.add(slot)
            del self.joining[slot]
            return
        self.joining[slot] = time.monotonic()

    def _joiners_due(self) -> bool:
        """Replacements join when every one started is up, or once one has waited JOIN_GRACE_S for another
        that is still starting (one join, one rebuild, for the replacements of a double loss)."""
        up = [t for t in self.joining.values() if t is not None]
        return bool(up) and (len(up) == len(self.joining) or time.monotonic() - min(up) > JOIN_GRACE_S)

    def _check_joiners(self) -> None:
        """A replacement that exited before joining is dropped (not replaced in turn: it would likely fail too)."""
        for slot, code in self.ranks.dead().items():
            if slot in self.joining:
                logger.warning("replacement rank %d %s before joining; not replaced", slot, _exit_text(code))
                del self.joining[slot]
                self.lost.add(slot)

    def _replace(self) -> None:
        """--elastic-ep-replace: start a replacement rank process for each rank lost while serving (once the
        survivors serve: its start would slow their re-formation); it says when it is up, and the survivors
        and it then re-form as one group again (step())."""
        while self._unreplaced and (self._spare is not None or self._next_slot < BOARD_SLOTS):
            if self._spare is not None:  # imported already: it joins in moments
                slot, self._spare = self._spare, None
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._unreplaced -= 1
            logger.warning("starting rank %d to replace a lost rank (--elastic-ep-replace)", slot)
            self.ranks.spawn_replacement(slot)
            self.joining[slot] = None

    def _spawn_spare(self) -> None:
        """--elastic-ep-replace: keep one rank process started ahead (it imports torch and the engine, several
        seconds of CPU, then waits), so a replacement joins in moments. Started at start-up and after each
        join, not while ranks re-form or join (it would slow them)."""
        if self._spare is None and self._next_slot < BOARD_SLOTS:
            self._spare, self._next_slot = self._next_slot, self._next_slot + 1
            self.ranks.spawn_spare(self._spare)

    def _start_recovery(self) -> None:
        """Drop the dead rank(s) and take in the replacements that are up; tell each rank its rank in a new
        epoch with a fresh rendezvous."""
        dead = self._newly_dead()
        if self.recovery is None:  # which rank process each request ran on (a loss while re-forming: kept)
            self._owners = {rid: self.slots[dp] for rid, dp in self.router.owner.items()}
        self.lost.update(dead)
        for r, code in sorted(dead.items()):
            logger.warning("rank %d %s: the %d other ranks re-form without it (--enable-elastic-ep)", r,
                           _exit_text(code), len(self.slots) - len(dead))
        self.elastic_stats.elastic_ranks_lost += len(dead)
        self.slots[:] = [s for s in self.slots if s not in self.lost]  # in place: the finalizer holds the list
        up = sorted(s for s, t in self.joining.items() if t is not None)
        for s in up:
            del self.joining[s]
            self.slots.append(s)
            logger.warning("replacement rank %d joins epoch %d", s, self.epoch + 1)
        self.elastic_stats.elastic_ranks_replaced += len(up)
        if self.replace:  # a replacement lost before it ever served is not replaced in turn: it would likely
            self._unreplaced += sum(r in self._served for r in dead)  # fail again, and again
            for r in sorted(set(dead) - self._served):
                logger.warning("replacement rank %d was lost before it served; not replaced", r)
            self._awaiting -= set(dead)
            if self._unreplaced and self._spare is not None:  # imported already: it joins this re-formation
                slot, self._spare = self._spare, None
                self._unreplaced -= 1
                logger.warning("rank %d (the spare) replaces a lost rank in epoch %d (--elastic-ep-replace)", slot,
                               self.epoch + 1)
                self.ranks.spawn_replacement(slot)
                self.slots.append(slot)
                self._awaiting.add(slot)
                self.elastic_stats.elastic_ranks_replaced += 1
        self.epoch += 1
        self.dp_size = len(self.slots)
        init = f"tcp://{self.config.parallel.master_addr}:{free_port()}"
        # the epoch's rendezvous lives here, not on a survivor that may die too; older ones stay (a survivor
        # still checking in at one would wait out its timeout on a closed store)
        self._epoch_stores.append(epoch_store(init, self.config.parallel.distributed_timeout))
        self._epoch_init = init
        for dp in range(self.dp_size):
            if self.slots[dp] not in self._awaiting:  # the spare gets it when it says it is up (_joiner_report)
                self._send(dp, RankCommand(reform=RankReform(self.epoch, dp, self.dp_size, init)))
        started = self.recovery["started"] if self.recovery else time.monotonic()  # a loss while re-forming
        grow = not dead and self.recovery is None  # only replacements join: no loss to recover from
        self.recovery = {"waiting": set(range(self.dp_size)), "started": started, "epoch_at": time.monotonic(),
                         "grow": grow, "kept": {}, "early": []}
        self._beats = None
        self._reset_ranks()

    def _poll_recovery(self, poll_s: float) -> None:
        rec, timeout = self.recovery, self.config.parallel.elastic_ep_timeout
        timeout_ms = int(poll_s * 1000)
        while self.recovery is rec and self.sock.poll(timeout_ms):
            timeout_ms = 0
            report = self._recv()
            if report is not None and report.ready:
                rec["waiting"].discard(report.dp_rank)
                rec["kept"][report.dp_rank] = report.kept
                self.num_kv_blocks = report.num_kv_blocks
            elif report is not None:  # a survivor that is ready steps on with the requests it kept (alone, or
                rec["early"].append(report)  # with others ready too): its tokens count after _adopt_kept
        if self.recovery is not rec:
            return  # another loss began a newer epoch
        if not rec["waiting"]:
            self._finish_recovery()
            for report in rec["early"]:  # only the requests that stayed on that rank (others were re-queued)
                report = msgspec.structs.replace(report, outputs=[
                    o for o in report.outputs if self.router.owner.get(o.request_id) == report.dp_rank])
                self._take_report(report, self._late)
        elif time.monotonic() - rec["epoch_at"] > timeout and not self._kill_laggards(timeout):
            self._fail(f"the {self.dp_size} surviving rank(s) did not re-form within {timeout:g} s "
                       f"(--elastic-ep-timeout); waiting for DP rank(s) {sorted(rec['waiting'])}")

    def _kill_laggards(self, timeout: float) -> bool:
        """A re-formation past --elastic-ep-timeout: kill the ranks the others wait on (their count of the
        epoch's collectives lags, as for a hung rank), so the next _check_alive re-forms without them. False
        when no rank can be named (all level: all stuck in the rendezvous or the build alike)."""
        if self._awaiting:  # a spare that never said it is up: the others wait for it at the store
            hung = sorted(self._awaiting)
        elif self.board is None:
            return False
        else:
            hung = hung_ranks({r: self.board.read(r) for r in self.slots}, self.epoch)
        if not hung or len(hung) == len(self.slots):
            return False
        for r in hung:
            logger.warning("rank %d did not re-form within %g s (--elastic-ep-timeout) while the other ranks of "
                           "epoch %d wait on it: killing it", r, timeout, self.epoch)
            self.ranks.kill_rank(r)
            self.hung_killed.append(r)
        return True

    def _finish_recovery(self) -> None:
        """The requests a survivor kept stay there; every other unfinished request goes to the survivors with
        its tokens so far (issue 31's resume)."""
        took, grow, kept = time.monotonic() - self.recovery["started"], self.recovery["grow"], self.recovery["kept"]
        self.recovery = None
        self._served.update(self.slots)
        self._beats = None  # the hang check starts afresh in the new epoch
        st = self.elastic_stats
        if not grow:  # from a loss seen to the survivors serving (a replacement joining is not a recovery)
            st.elastic_last_recovery_s = took
            st.elastic_recovery_s += took
        staying = self._adopt_kept(kept)
        for rid, (req, seen) in self.requests.items():
            if rid in staying:
                continue
            out = list(req.output_token_ids) + seen
            params = req.sampling_params
            if seen and params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=None)  # the caller has them already
            # a survivor's own request goes back to it: its engine core kept the prefix cache, so the recompute
            # of the prompt and the output so far is mostly cache hits (engine/elastic.py, roll_back)
            owner = self._owners.get(rid)
            rank = self.slots.index(owner) if owner in self.slots else None
            self._route(msgspec.structs.replace(req, sampling_params=params, output_token_ids=out), rank)
            st.elastic_requeued += 1
            st.elastic_tokens_recomputed += len(req.prompt_token_ids) + len(out)
        self._owners = {}
        self._last_progress = time.monotonic()
        logger.warning("epoch %d: %d rank(s) serve again after %.2f s; %d request(s) kept where they ran, %d "
                       "re-queued", self.epoch, self.dp_size, took, len(staying), len(self.requests) - len(staying))
        self._replace()
        if self.replace and not self.joining:
            self._spawn_spare()

    def _adopt_kept(self, kept: dict[int, dict[str, int]]) -> set[str]:
        """The requests the survivors kept scheduled (their ready reports: DP rank -> {request id: output
        tokens}) that stay there: unfinished here with exactly the tokens seen here (a survivor's outputs of the
        older epoch are read before its ready report: _late_outputs). The router counts them on that rank.
        Others a survivor holds are aborted there: finished or aborted here meanwhile (the abort was dropped
        with the older epoch), or out of step with what was seen (re-queued then, as a lost rank's)."""
        staying: set[str] = set()
        for dp, held in sorted(kept.items()):
            aborts = []
            for rid, n in held.items():
                entry = self.requests.get(rid)
                if entry is None or rid in staying or len(entry[0].output_token_ids) + len(entry[1]) != n:
                    aborts.append(rid)
                    continue
                req, seen = entry
                staying.add(rid)
                prompt = req.prompt_token_ids + list(req.output_token_ids) + seen
                max_new = max(1, (req.sampling_params.max_tokens or self.config.scheduler.max_model_len) - n)
                self.router.assign(rid, 0, max_new, prompt, rank=dp)  # nothing to prefill: its KV is there
            if aborts:  # before any re-queue of the same id: the rank applies its commands in order
                self._send(dp, RankCommand(aborts=aborts, abort_status=RequestStatus.FINISHED_ABORTED.value))
        return staying

    def _fail(self, message: str) -> None:
        self.dead = message
        self._finalizer()
        raise EngineDeadError(message)


def _stop(sock, ranks: LocalRanks, slots: list[int], board=None, joining: dict | None = None,
          awaiting: set | None = None) -> None:
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
