"""The front end of a multi-rank engine, with EngineCore's interface (add_request, abort_requests, step,
has_unfinished, stats), so the offline LLM and the server's engine-core process host either.

Lifecycle: __init__ launches the local ranks (launch.py) and waits until every DP rank's TP leader has
loaded its shard and reported ready -> add_request sends each request to the DP rank with the least
outstanding work (prompt tokens + tokens still to generate of its unfinished requests) -> step() returns
the outputs the ranks reported since the last call -> shutdown() tells all ranks to stop together.
If a rank dies or reports a failure, step() raises EngineDeadError naming the rank; the other ranks are
stopped (their collectives fail, or they are killed after the timeout).
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
from moeserve.engine.launch import LocalRanks, TorchrunEnv, resolve_endpoints
from moeserve.engine.request import RequestStatus
from moeserve.protocol import (EngineCoreOutput, EngineCoreRequest, EngineStats, RankCommand, RankReport,
                               add_slo_stats, add_spec_stats)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a big checkpoint on every rank takes a while


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
    def __init__(self, config: EngineConfig, torchrun: TorchrunEnv | None = None) -> None:
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
        self.ranks = LocalRanks(self.config, init_method, zmq_addr, torchrun)
        self._finalizer = weakref.finalize(self, _stop, self.sock, self.ranks, self.dp_size)
        self.decoder = msgspec.msgpack.Decoder(RankReport)
        cache = config.cache  # with prefix caching the router prefers the rank that has the prompt's prefix
        self.router = LeastLoadedRouter(self.dp_size, cache.block_size if cache.enable_prefix_caching else None)
        self.rank_stats: list[EngineStats] = [EngineStats() for _ in range(self.dp_size)]
        self.sent_since_report = [0] * self.dp_size  # requests routed to a rank after its last report
        self.dead: str | None = None
        self.num_kv_blocks = 0
        self._last_progress = time.monotonic()
        self._last_report = [time.monotonic()] * self.dp_size  # per DP rank, for the stall check
        self._busy_since = time.monotonic()
        self._wait_ready()

    # ---- EngineCore interface ----------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self._check_alive()  # a stopped engine answers EngineDeadError, not a closed-socket error
        max_new = req.sampling_params.max_tokens or self.config.scheduler.max_model_len
        if not self.router:
            self._busy_since = time.monotonic()
        ttft = None
        if req.slo_ttft_ms is not None or self.config.scheduler.slo_ttft_ms is not None:
            st = self.rank_stats
            ttft = slo_ranked_ttft([s.slo_ttft_estimate_s for s in st], [s.slo_prefill_estimate_s for s in st],
                                   self.sent_since_report)
        dp = self.router.assign(req.request_id, len(req.prompt_token_ids), max_new, req.prompt_token_ids, ttft)
        self.sent_since_report[dp] += 1
        self._send(dp, RankCommand(requests=[req]))

    def abort_requests(self, request_ids: list[str], reason: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        by_rank: dict[int, list[str]] = {}
        unknown = []
        for rid in request_ids:
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
        return bool(self.router)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.rank_stats)

    def step(self, poll_s: float = 0.05) -> list[EngineCoreOutput]:
        """Outputs reported since the last call (waits up to poll_s for the first)."""
        self._check_alive()
        outputs: list[EngineCoreOutput] = []
        timeout_ms = int(poll_s * 1000)
        heard = False
        while self.sock.poll(timeout_ms):
            timeout_ms, heard = 0, True
            report = self._recv()
            self._last_report[report.dp_rank] = time.monotonic()
            self.rank_stats[report.dp_rank] = report.stats or self.rank_stats[report.dp_rank]
            if report.stats:
                self.sent_since_report[report.dp_rank] = 0
            for out in report.outputs:
                if out.request_id not in self.router:
                    continue  # aborted here already
                self.router.progress(out.request_id, len(out.new_token_ids))
                if out.finish_reason is not None:
                    self.router.forget(out.request_id)
                outputs.append(out)
        if heard or not self.router:  # every step reports, so a long chunked prefill is progress too
            self._last_progress = time.monotonic()
        elif (silent := time.monotonic() - self._last_progress) > self.stall_timeout and self.ranks.stopped():
            # a stopped rank (SIGSTOP) never resumes by itself: dead now, not after the gloo timeout; a rank
            # that is merely slow (a long step) is not stopped, and only --distributed-timeout ends that
            r, t = self.ranks.stopped()[0], self.tp_size
            self.ranks.kill()  # the others wait in a collective with it: no clean exit to wait for
            self._fail(f"rank {r} (dp {r // t}, tp {r % t}) is stopped (SIGSTOP or a debugger) and no rank "
                       f"progressed for {silent:.1f} s (--engine-stall-timeout {self.stall_timeout:g}); "
                       "the engine stopped")
        elif silent > self.timeout:
            self._fail(f"no report from any rank for {self.timeout:.0f} s (--distributed-timeout) while "
                       f"{len(self.router)} request(s) are unfinished")
        return outputs

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
        return total

    def stalled_s(self) -> float:
        """Seconds the quietest DP rank has not reported while requests are unfinished. With work anywhere
        every rank steps (lockstep) and reports each step, so a silent rank is a hung one (SIGSTOP, a stuck
        collective), long before --distributed-timeout declares it dead."""
        if not self.router:
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
        self.sock.send_multipart([f"dp{dp}".encode(), msgspec.msgpack.encode(cmd)])

    def _recv(self) -> RankReport:
        _, payload = self.sock.recv_multipart()
        report = self.decoder.decode(payload)
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
                ready.add(report.dp_rank)
                self.num_kv_blocks = report.num_kv_blocks  # per DP rank (all ranks size their pool alike)

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        cause = self._dead_rank_text()
        if cause:
            self._fail(cause)

    def _dead_rank_text(self) -> str | None:
        dead = self.ranks.dead()
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


def _stop(sock, ranks: LocalRanks, dp_size: int) -> None:
    """Ask every DP rank to shut down, then make sure the local processes are gone."""
    try:
        for dp in range(dp_size):
            sock.send_multipart([f"dp{dp}".encode(), msgspec.msgpack.encode(RankCommand(shutdown=True))],
                                flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    ranks.join(timeout=10)
    ranks.kill()
    sock.close()
