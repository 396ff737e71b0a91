"""The engine-core process: an EngineCore behind a ZMQ ROUTER socket, in a busy loop.

Lifecycle: the launcher spawns run_engine_core(); it builds the EngineCore (loads the model), binds the
ROUTER socket and then serves until SIGTERM/SIGINT or until its parent dies. API-server processes connect
with DEALER sockets, say hello (MSG_HELLO) and get EngineCoreReady back; from then on they send requests
and aborts and receive EngineCoreOutputs batches. Every payload is a msgspec struct (protocol.py), so
nothing from a socket is ever unpickled.

The wrapper is deliberately thin: it owns only routing (which client sent which request), the bounded
waiting queue and the heartbeat. Anything with EngineCore's interface (add_request, abort_requests,
has_unfinished, step, stats) can sit behind it, e.g. one data-parallel rank.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import msgspec
import zmq

from moeserve.protocol import (MSG_ABORT, MSG_ADD, MSG_FATAL, MSG_GOODBYE, MSG_HELLO, MSG_OUTPUTS, MSG_UTILITY, UTILITY_CALLS,
                               EngineCoreAbort,
                               EngineCoreHello, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady,
                               EngineCoreRequest, EngineCoreUtility, EngineCoreUtilityResult)

logger = logging.getLogger("moeserve.engine_core")

HEARTBEAT_S = 0.25  # stats to every client at least this often, busy or idle (liveness + fresh gauges)
KV_POLL_S = 0.002
EXIT_RANK_DIED = 3  # the exit code when a DP/TP rank process died or stopped answering  # how often an engine with nothing to compute polls its KV transfers (PD)


# Testing only: an engine core that steps a request whose prompt holds this token id kills itself (SIGKILL, as
# a crash in a kernel would end it), every time: the request that crashes the engine on every core
# (tests/entrypoints/test_request_resume.py). Unset: no check.
CRASH_TOKEN = int(os.environ["MOESERVE_TEST_CRASH_TOKEN"]) if os.environ.get("MOESERVE_TEST_CRASH_TOKEN") else None

# The admission bounds this process enforces -> the flag its refusal names (vllm:admission_rejections' reason;
# the API server reads the reason back from the message, engine_client.admission_reason)
ADMISSION_FLAGS = {"max_num_queued_reqs": "(--max-num-queued-reqs)", "max_waiting_requests": "(--max-waiting-requests)"}


class EngineCoreProc:
    def __init__(self, core, address: str, engine_index: int = 0, max_waiting_requests: int | None = None,
                 max_num_queued_reqs: int | None = None, log_stats: bool = True):
        self.core = core
        self.engine_index = engine_index
        self.max_waiting = max_waiting_requests
        self.max_in_flight = max_num_queued_reqs  # vLLM's bound: waiting + running requests
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises instead of blocking
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a busy client's outputs (clients are our own processes)
        self.sock.bind(address)
        self.clients: set[bytes] = set()
        self.owner: dict[str, bytes] = {}  # request id -> client identity
        self.encoder = msgspec.msgpack.Encoder()
        self.dec_req = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.dec_abort = msgspec.msgpack.Decoder(EngineCoreAbort)
        self.dec_hello = msgspec.msgpack.Decoder(EngineCoreHello)
        self.parent = os.getppid()
        self.running = True
        self._last_beat = 0.0
        from moeserve.engine.stats_log import StatsLogger
        self.stats_logger = StatsLogger(engine_index) if log_stats else None
        self._started: set[str] = set()  # requests that have had their first tokens (prompt tokens counted)
        # clients a send failed to, reported after the next drain unless their goodbye was read meanwhile
        self._lost: dict[bytes, Exception] = {}
        self._poisoned: set[str] = set()  # MOESERVE_TEST_CRASH_TOKEN: requests whose step kills this process

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            # PD: an engine waiting only on KV transfers polls them every KV_POLL_S instead of spinning
            kv = getattr(self.core, "kv_transfer_pending", False)
            compute = self.core.has_schedulable() if kv else self.core.has_unfinished()
            if self.sock.poll(0 if compute else int((KV_POLL_S if kv else HEARTBEAT_S) * 1000)):
                self._drain()
            self._report_lost()
            if kv:
                self.core.poll_kv_transfer()
            if self.core.has_schedulable() if kv else self.core.has_unfinished():
                if self._poisoned:
                    self._crash_if_poisoned()
                self._send_outputs(self.core.step())
            now = time.monotonic()
            if now - self._last_beat >= HEARTBEAT_S:
                self._heartbeat(now)
        self._say_goodbye()
        self.sock.close(0)
        self.ctx.term()

    def _drain(self) -> None:
        while True:
            try:
                ident, kind, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(ident, kind, payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropping a malformed %r message from %r: %s", kind, ident, e)
                if kind == MSG_ADD:
                    self._refuse_unreadable(ident, payload, e)

    def _refuse_unreadable(self, ident: bytes, payload: bytes, e: Exception) -> None:
        """A request that does not decode (its params fail validation here) still gets an answer, so its
        client does not wait for it forever: the id is the first field of the array-like struct."""
        try:
            rid = msgspec.msgpack.decode(payload)[0]
        except Exception:  # noqa: BLE001 - not even an id: nobody can be answered
            return
        if isinstance(rid, str):
            err = EngineCoreOutput(rid, [], finish_reason="abort", error_kind="invalid",
                                   error=f"the engine core could not read the request: {e}")
            self._send(ident, MSG_OUTPUTS, EngineCoreOutputs([err], self.core.stats(), self.engine_index))

    def _handle(self, ident: bytes, kind: bytes, payload: bytes) -> None:
        if kind == MSG_ADD:
            self._add(ident, self.dec_req.decode(payload))
        elif kind == MSG_ABORT:
            ids = self.dec_abort.decode(payload).request_ids
            self.core.abort_requests(ids)
            for rid in ids:
                self.owner.pop(rid, None)
        elif kind == MSG_HELLO:
            self.dec_hello.decode(payload)
            self.clients.add(ident)
            ready = EngineCoreReady(self.engine_index, os.getpid(), self.core.num_kv_blocks)
            self._send(ident, MSG_HELLO, ready)
        elif kind == MSG_UTILITY:
            self._utility(ident, msgspec.msgpack.decode(payload, type=EngineCoreUtility))
        elif kind == MSG_GOODBYE:  # an API server stops cleanly: nothing more goes to it, and that is no loss
            self._lost.pop(ident, None)
            if ident in self.clients:
                logger.debug("client %r said goodbye", ident)
                self._drop_client(ident)
        else:
            logger.error("unknown message kind %r from %r", kind, ident)

    def _utility(self, ident: bytes, call: EngineCoreUtility) -> None:
        """A management call from an API server (/reset_prefix_cache, ...): run it, answer its result."""
        if call.method not in UTILITY_CALLS:
            answer = EngineCoreUtilityResult(call.call_id, error=f"unknown engine call {call.method!r}")
        else:
            answer = EngineCoreUtilityResult(call.call_id, result=getattr(self.core, call.method)())
        self._send(ident, MSG_UTILITY, answer)

    def _refuse(self, ident: bytes, req: EngineCoreRequest, message: str) -> None:
        err = EngineCoreOutput(req.request_id, [], finish_reason="abort", error_kind="overloaded", error=message)
        self._send(ident, MSG_OUTPUTS, EngineCoreOutputs([err], self.core.stats(), self.engine_index))

    def _add(self, ident: bytes, req: EngineCoreRequest) -> None:
        if self.max_in_flight is not None and len(self.owner) >= self.max_in_flight:
            self._refuse(ident, req, f"the server is overloaded: {self.max_in_flight} requests are already in "
                                     f"flight {ADMISSION_FLAGS['max_num_queued_reqs']}; retry later")
            return
        if self.max_waiting is not None and self.core.num_waiting >= self.max_waiting:
            err = EngineCoreOutput(req.request_id, [], finish_reason="abort", error_kind="overloaded",
                                   error=f"the server is overloaded: {self.max_waiting} requests are already "
                                         f"waiting {ADMISSION_FLAGS['max_waiting_requests']}; retry later")
            self._send(ident, MSG_OUTPUTS, EngineCoreOutputs([err], self.core.stats(), self.engine_index))
            return
        self.owner[req.request_id] = ident
        if CRASH_TOKEN is not None and CRASH_TOKEN in req.prompt_token_ids:
            self._poisoned.add(req.request_id)
        self.core.add_request(req)

    def _crash_if_poisoned(self) -> None:
        """MOESERVE_TEST_CRASH_TOKEN: the step about to run holds a poisoned request: die as a crash would."""
        self._poisoned &= self.owner.keys()  # finished or aborted ones are gone
        if self._poisoned:
            logger.error("MOESERVE_TEST_CRASH_TOKEN: request(s) %s in this step; the engine core kills itself",
                         sorted(self._poisoned))
            os.kill(os.getpid(), signal.SIGKILL)

    # ---- sending ---------------------------------------------------------------------------------
    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            ident = self.owner.get(out.request_id)
            if ident is None:
                continue  # aborted by its client after the step was scheduled
            if out.finish_reason is not None:
                del self.owner[out.request_id]
            if out.error and not out.error_kind:
                out.error_kind = "invalid"
            by_client.setdefault(ident, []).append(out)
        stats = self.core.stats()
        if self.stats_logger is not None:
            self._count(outputs)
            self.stats_logger.maybe_log(stats)
        now = time.time()
        for ident, outs in by_client.items():
            self._send(ident, MSG_OUTPUTS, EngineCoreOutputs(outs, stats, self.engine_index, now))

    def _count(self, outputs: list[EngineCoreOutput]) -> None:
        prompt = generated = 0
        for out in outputs:
            if out.new_token_ids and out.request_id not in self._started:
                self._started.add(out.request_id)
                prompt += out.num_prompt_tokens - out.num_cached_tokens
            generated += len(out.new_token_ids)
            if out.finish_reason is not None:
                self._started.discard(out.request_id)
        self.stats_logger.count(prompt, generated)

    def tell_clients_why(self, reason: str) -> None:
        """Before dying: the API servers pass the reason (which rank, how) to the requests they end."""
        for ident in list(self.clients):
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, MSG_FATAL, reason.encode()], zmq.NOBLOCK)
        self.sock.close(linger=1000)  # up to 1 s to deliver them before the process exits
        self.ctx.term()

    def _say_goodbye(self) -> None:
        """A clean stop: tell the API servers first, so they log it as such and not as a crash."""
        for ident in list(self.clients):
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, MSG_GOODBYE, b""], zmq.NOBLOCK)

    def _heartbeat(self, now: float) -> None:
        self._last_beat = now
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self.core.stats())
        if os.getppid() != self.parent:
            logger.error("the launcher process died; the engine core exits")
            self.running = False
            return
        # stamped: every client measures the core's silence from this one instant (protocol.EngineCoreOutputs)
        beat = EngineCoreOutputs([], self.core.stats(), self.engine_index, time.time(), time.monotonic())
        for ident in list(self.clients):
            self._send(ident, MSG_OUTPUTS, beat)

    def _send(self, ident: bytes, kind: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, kind, self.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the client went away (EHOSTUNREACH) or is not reading (EAGAIN)
            # Reported after the next drain (_report_lost): an API server that stops cleanly says goodbye
            # before it closes its socket, and its goodbye may still wait, unread, behind this send (the
            # launcher stops the API servers first, and the core heartbeats until its own SIGTERM).
            self._lost.setdefault(ident, e)
            self._drop_client(ident)

    def _report_lost(self) -> None:
        """Clients a send failed to and that did not say goodbye: they vanished (a crash, a kill)."""
        for ident, e in self._lost.items():
            (logger.warning if self.running else logger.debug)(
                "client %r unreachable (%s) without saying goodbye; dropped it and its requests", ident, e)
        self._lost.clear()

    def _drop_client(self, ident: bytes) -> None:
        self.clients.discard(ident)
        gone = [rid for rid, owner in self.owner.items() if owner == ident]
        self.core.abort_requests(gone)
        for rid in gone:
            del self.owner[rid]


class _PipeReady:
    """A standby's ready signal: a message on its pipe to the launcher (no semaphores to leak)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def set(self) -> None:
        self.conn.send("ready")


def _wait_for_go(conn, parent: int) -> bool:
    """A standby engine core waits until the launcher needs it: True on "go"; False when the launcher closed
    the pipe or died (it then exits without ever building an engine)."""
    while os.getppid() == parent:
        try:
            if conn.poll(1.0):
                return conn.recv() == "go"
        except (EOFError, OSError):
            return False
    return False


def run_engine_core(config, address: str, engine_index: int = 0, max_waiting_requests: int | None = None,
                    log_level: str = "INFO", ready_event=None, max_num_queued_reqs: int | None = None,
                    log_stats: bool = True, standby=None) -> None:
    """Process entry point (spawned by the launcher). standby: a pipe to the launcher; this process is then
    the next engine core, started ahead of need: it imports the engine and starts its rank processes (which
    import theirs), waits for "go" on the pipe (sent when the current core died), and only then builds the
    engine, binds `address` and answers "ready" on the pipe. A restart thus does not wait for interpreters to
    start and import torch (about half of a DP engine's start on a busy 2-core machine)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(message)s")
    from moeserve.engine.launch import local_rank_processes, make_engine_core, spawn_rank_processes
    from moeserve.structured.params import compile_in_this_process

    # Ctrl-C in a terminal signals every process of the group: the launcher alone decides, and stops this
    # one (SIGTERM) after the API servers drained. Set before the ranks start, so they inherit it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    compile_in_this_process(False)  # requests bring their compiled automata: nothing compiles on this loop
    # The checkpoint loader's tqdm would make a multiprocessing lock: a named semaphore registered with the
    # launcher's resource tracker, which a core killed by a signal never unregisters ("1 leaked semaphore
    # objects" when the deployment stops, one per kill -9). No other process writes this core's bars.
    import threading
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
    prespawned = None
    if standby is not None:
        parent = os.getppid()
        prespawned = spawn_rank_processes(config) if local_rank_processes(config) else None
        import moeserve.engine.engine_core  # noqa: F401  (make_engine_core imports it)
        if prespawned is None:  # the model is built here: what its build imports (see dp_worker.main)
            import torch._dynamo  # noqa: F401
        else:  # a DP front end: not torch._dynamo, which it never needs and whose objects made its exit
            import moeserve.engine.dp_client  # noqa: F401  (interpreter teardown's last GC) take 6 s
        if not _wait_for_go(standby, parent):
            for proc in (prespawned or {}).values():
                proc.stdin.close()  # nothing written: the rank exits at once
            return
        ready_event = _PipeReady(standby)
    core = make_engine_core(config, prespawned=prespawned)  # EngineCore, or the front end of D x T ranks
    proc = EngineCoreProc(core, address, engine_index, max_waiting_requests, max_num_queued_reqs, log_stats)

    def stop(signum, frame):
        proc.running = False

    signal.signal(signal.SIGTERM, stop)
    logger.info("engine core %d ready (pid %d, %d KV blocks) on %s", engine_index, os.getpid(),
                core.num_kv_blocks, address)
    if ready_event is not None:
        ready_event.set()
    from moeserve.engine.dp_client import EngineDeadError
    try:
        proc.run()
    except EngineDeadError as e:  # a rank died or hung: the message names it; the launcher restarts us
        logger.error("engine core %d stops: %s", engine_index, e)
        proc.tell_clients_why(str(e))
        raise SystemExit(EXIT_RANK_DIED) from None
    core.flush_stats()  # --expert-load-stats: the last counts
    logger.info("engine core %d stopped", engine_index)
