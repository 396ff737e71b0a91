"""The API server's side of the engine-core connection: asyncio over a ZMQ DEALER socket.

Lifecycle: start() says hello and waits for EngineCoreReady; then one task reads output batches,
detokenizes them (OutputProcessor: text deltas, stop strings) and feeds each request's queue, and another
watches the connection. generate() yields a request's Deltas; leaving it early (client gone, stop string)
aborts the request in the core, which frees its KV blocks. When the core dies every waiting request gets
503 at once (EngineDeadError), while a fresh socket says hello until the core the launcher restarts answers.
Requests in flight survive the restart: each stream keeps its EngineCoreRequest, and its tokens so far live
in the OutputProcessor, so once the new core answers the request is sent again with them
(EngineCoreRequest.output_token_ids) and its stream goes on where it stopped, no token lost or repeated (the
detokenizer state, stop strings and logprob offsets simply continue). A request that was in flight during
MAX_REQUEST_CRASHES engine deaths in a row is a suspect: suspects are resumed one at a time, each the only
suspect in flight until it has produced PROBATION_TOKENS tokens (or finished), and the one in flight alone
when the engine dies again is failed (it is what kills the engine); the other requests in flight through the
same deaths are resumed and finish. A core that
sends nothing (it heartbeats every 0.25 s) for --engine-stall-timeout counts as hung (stall_reason: /health
503).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from moeserve.engine.output_processor import Delta, OutputProcessor
from moeserve.protocol import (MSG_ABORT, MSG_ADD, MSG_FATAL, MSG_GOODBYE, MSG_HELLO, MSG_OUTPUTS, MSG_UTILITY, EngineCoreAbort,
                               EngineCoreHello, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
                               EngineCoreUtility, EngineCoreUtilityResult, EngineStats)
from moeserve.sampling_params import SamplingParams
from moeserve.structured.params import structured_grammar

logger = logging.getLogger("moeserve.api")

LIVENESS_CHECK_S = 0.5
GOODBYE_LINGER_MS = 1000  # at most this long at close for the goodbye to reach the core
# A request in flight during this many engine-core deaths in a row is a suspect, resumed alone among
# suspects; the suspect in flight alone when the core dies again fails (with an error saying so): it is what
# kills the core, and the launcher gives up after --max-engine-restarts (3) deaths in a row. 1: no request
# is resumed (each death fails them, as before).
MAX_REQUEST_CRASHES = int(os.environ.get("MOESERVE_MAX_REQUEST_CRASHES", "2"))
# A suspect resumed alone that produces this many tokens (or finishes) on the new core is cleared (its crash
# count starts again from 0) and the next suspect is resumed: a request that kills the engine every time
# kills it again on its first steps there (its tokens so far are recomputed, then it decodes on).
PROBATION_TOKENS = 4
# Deaths count as "in a row" unless the core served this long in between (the launcher's HEALTHY_RUN_S).
CRASH_COUNT_RESET_S = 60.0


class EngineDeadError(RuntimeError):
    pass


class EngineRequestError(RuntimeError):
    """The core refused or failed a request: kind "invalid" (a 400), "overloaded" (a 503), "internal" (a 500)."""

    def __init__(self, message: str, kind: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s  # an "overloaded" refusal: when to retry (Retry-After)


@dataclass
class _Stream:
    queue: asyncio.Queue
    prompt_len: int
    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    num_cached: int = 0  # prompt tokens the prefix cache served (from the first output)
    queue_time: float = 0.0  # seconds in the engine's queue before the first step (from the first output)
    num_preemptions: int = 0  # times the engine preempted it (from its last output)
    request: EngineCoreRequest | None = None  # as sent: what a resume sends again, with the tokens so far
    crashes: int = 0  # engine-core deaths in a row this request was in flight for
    lost_at: float | None = None  # perf_counter() when its core died, until the new core's first output
    on_core: bool = False  # sent to the core now serving (or the one that just died)
    suspect: bool = False  # in flight during MAX_REQUEST_CRASHES deaths in a row: waits to be resumed alone
    probation: int = 0  # while it is the suspect resumed alone: tokens it still has to produce to be cleared


def _params_text(params: SamplingParams) -> str:
    """The request's non-default sampling parameters, for --enable-log-requests."""
    default = SamplingParams()
    return ", ".join(f"{k}={v!r}" for k, v in vars(params).items() if v != getattr(default, k, None))


def admission_reason(out) -> str | None:
    """The queue bound (vllm:admission_rejections' reason) an engine-core refusal names, if it is one."""
    from moeserve.engine.engine_core_proc import ADMISSION_FLAGS
    if out.error_kind != "overloaded" or not out.error:
        return None
    return next((reason for reason, flag in ADMISSION_FLAGS.items() if flag in out.error), None)


class EngineClient:
    def __init__(self, address: str, tokenizer, eos_token_ids: list[int], client_index: int = 0,
                 metrics=None, stall_timeout: float = 5.0) -> None:
        self.address = address
        self.eos_token_ids = list(eos_token_ids)
        self.client_index = client_index
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.processor = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self.ctx = zmq.asyncio.Context()
        self.sock = self.monitor = None
        self._connect()
        self.encoder = msgspec.msgpack.Encoder()
        self.dec_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready: EngineCoreReady | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self.last_heard = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._reconnecting: asyncio.Task | None = None
        self.log_requests = False  # --enable-log-requests
        self.max_log_len: int | None = None  # --max-log-len: the log also shows the first N prompt chars / ids
        self.logprobs_mode = "raw_logprobs"  # --logprobs-mode: the engine's sampler reads it from each request
        self._core_stopping = False  # the core said goodbye: its disconnect is a shutdown, not a crash
        self._core_fatal: str | None = None  # what the core said before it died (MSG_FATAL)
        self._calls: dict[int, asyncio.Future] = {}  # utility calls waiting for the core's answer
        self._call_ids = 0
        self._up_since = time.monotonic()  # when the current core answered (the crash count's reset)
        self._isolated: str | None = None  # the suspect resumed alone now (the only suspect in flight)
        self._pending: set[asyncio.Task] = set()

    # ---- lifecycle -------------------------------------------------------------------------------
    def _connect(self) -> None:
        """A fresh DEALER socket: nothing queued for a core that died reaches the one that replaces it."""
        if self.sock is not None:
            self.monitor.close(0)
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"api-{self.client_index}-{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.address)
        self._core_stopping = False  # a new core: its disconnect is a crash again until it says goodbye
        self._core_fatal = None

    async def start(self, timeout: float = 60.0) -> None:
        if not await self._handshake(timeout):
            raise EngineDeadError(f"the engine core at {self.address} did not answer within {timeout:.0f} s")
        self._run()

    async def _handshake(self, timeout: float, resend_s: float = 1.0) -> bool:
        """Say hello (again every resend_s: a core still starting has not bound yet) until it answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self.sock.send_multipart([MSG_HELLO, self.encoder.encode(EngineCoreHello(self.client_index))])
            until = min(deadline, time.monotonic() + resend_s)
            while (left := until - time.monotonic()) > 0 and await self.sock.poll(left * 1000):
                kind, payload = await self.sock.recv_multipart()
                if kind == MSG_HELLO:
                    self.ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
                    if self.metrics:
                        self.metrics.engine_ready(self.ready.num_kv_blocks)
                    return True
        return False

    def _run(self) -> None:
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """Say goodbye to the core (a clean stop: it drops this client without a warning) and close."""
        for t in self._tasks + ([self._reconnecting] if self._reconnecting else []):
            t.cancel()
        linger = 0
        if self.dead_reason is None and self.ready is not None:
            try:
                await self.sock.send_multipart([MSG_GOODBYE, b""], zmq.NOBLOCK)
                linger = GOODBYE_LINGER_MS  # the goodbye leaves before the socket closes (a live core reads it)
            except zmq.ZMQError:
                pass
        self.monitor.close(0)
        self.sock.close(linger)
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def stall_reason(self) -> str | None:
        """Why the engine counts as hung: nothing heard from the core (it heartbeats every 0.25 s, busy or
        idle), or a DP rank with work silent, for longer than --engine-stall-timeout. None when neither."""
        quiet = time.monotonic() - self.last_heard
        if quiet > self.stall_timeout:
            return f"the engine core has sent nothing for {quiet:.0f} s (--engine-stall-timeout {self.stall_timeout:g})"
        if self.stats.stalled_s > self.stall_timeout:
            return (f"a data-parallel rank with work has reported nothing for {self.stats.stalled_s:.0f} s "
                    f"(--engine-stall-timeout {self.stall_timeout:g})")
        return None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        if self._core_fatal:  # the core said why before it went (MSG_FATAL)
            reason = f"the engine core stopped: {self._core_fatal}"
        self.dead_reason = reason
        if time.monotonic() - self._up_since >= CRASH_COUNT_RESET_S:
            for st in self.streams.values():
                st.crashes = 0  # the core served a while: this death does not follow the last one
        # the requests this core had: those waiting to be resumed (suspects included) were not in flight
        in_flight = [rid for rid, st in self.streams.items() if st.on_core or st.request is None]
        isolated, self._isolated = self._isolated, None
        failed = suspects = 0
        for rid in in_flight:
            st = self.streams[rid]
            st.on_core = False
            why = self._not_resumable(st, reason, alone=rid == isolated or len(in_flight) == 1)
            if why is None:
                if st.lost_at is None:
                    st.lost_at = time.perf_counter()
                if st.crashes >= MAX_REQUEST_CRASHES:
                    st.suspect = True
                    suspects += 1
                continue
            failed += 1
            st.queue.put_nowait(EngineDeadError(why))
            self.processor.states.pop(rid, None)
        if self._core_stopping:
            for rid, st in list(self.streams.items()):  # no core comes back for those waiting either
                if rid not in in_flight:
                    st.queue.put_nowait(EngineDeadError(reason))
                    self.processor.states.pop(rid, None)
            logger.info("engine core stopped; answering 503 until it is back or this server stops")
        else:
            logger.error("engine core is gone: %s; answering 503 until it is back (%d requests in flight resume "
                         "then, %d of them one at a time as suspects; %d failed)", reason,
                         len(in_flight) - failed, suspects, failed)
        if self.metrics:
            self.metrics.engine_alive.set(0)
        self._reconnecting = asyncio.create_task(self._reconnect())

    def _not_resumable(self, st: _Stream, reason: str, alone: bool) -> str | None:
        """Why a request in flight when the core died cannot wait for the next core (its error), or None.
        Counts the death for it. alone: it was the only suspect in flight (resumed alone), or the only request
        in flight at all: nothing else can have killed the core."""
        if self._core_stopping:  # a shutdown, not a crash: no core comes back
            return reason
        if st.request is None:  # not sent yet: generate() reports the failed send itself
            return reason
        if st.request.kv_transfer_params is not None:  # PD: the KV it was to pull (or hold) died with the core
            self._count_not_resumed("disaggregated")
            return f"{reason}; a prefill/decode-disaggregated request is not resumed on a restarted core"
        st.crashes += 1
        if st.crashes >= MAX_REQUEST_CRASHES and (alone or MAX_REQUEST_CRASHES <= 1):
            self._count_not_resumed("crash_limit")
            return (f"{reason}; this request was in flight during {st.crashes} engine-core deaths in a row, the "
                    f"last with no other suspect in flight, so it is failed rather than resumed again: it is what "
                    f"kills the engine (MOESERVE_MAX_REQUEST_CRASHES={MAX_REQUEST_CRASHES})")
        return None

    def _count_not_resumed(self, reason: str) -> None:
        if self.metrics:
            self.metrics.not_resumed[reason].inc()

    async def _reconnect(self) -> None:
        """Wait for the launcher's new engine core (same address), then serve again and resume the requests
        that were in flight."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._connect()
        while not await self._handshake(60.0):
            pass
        self.stats = EngineStats()
        self.dead_reason = None
        self._up_since = time.monotonic()
        self._run()
        resumed = await self._resume()
        if self.metrics:
            self.metrics.engine_alive.set(1)
        logger.info("connected to the engine core again (pid %d); %d requests in flight resumed", self.ready.pid,
                    resumed)

    async def _resume(self) -> int:
        """Send every request that outlived its core to the new one, with the tokens it already streamed as
        its output so far: the new core recomputes their KV (as for a preemption) and samples the next token
        exactly where the dead one would have (greedy and seeded alike: protocol.EngineCoreRequest)."""
        n = 0
        for rid, st in list(self.streams.items()):
            if self.dead_reason is not None:  # the new core died too: the next reconnect resumes the rest
                break
            if st.lost_at is None or st.on_core or st.suspect:
                continue
            n += await self._send_resumed(rid, st)
        return n + await self._isolate_next()

    async def _send_resumed(self, rid: str, st: _Stream) -> int:
        """Send one request that outlived its core to the current one, with its tokens so far; 1 if sent."""
        state = self.processor.states.get(rid)
        if state is None or self.dead_reason is not None:
            return 0
        params = st.request.sampling_params
        if state.token_ids and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)  # the client has them already
        req = msgspec.structs.replace(st.request, sampling_params=params, output_token_ids=list(state.token_ids))
        st.on_core = True
        await self.sock.send_multipart([MSG_ADD, self.encoder.encode(req)])
        return 1

    async def _isolate_next(self) -> int:
        """Resume the next suspect, if none is in flight: alone among suspects, so if the core dies again it
        was this one (the others in flight are through fewer deaths). 1 if one was sent."""
        if self._isolated is not None or self.dead_reason is not None:
            return 0
        rid = next((rid for rid, st in self.streams.items() if st.suspect), None)
        if rid is None:
            return 0
        st = self.streams[rid]
        st.suspect, st.probation = False, PROBATION_TOKENS
        self._isolated = rid
        logger.warning("resuming request %s alone among suspects: it was in flight during %d engine-core deaths "
                       "in a row; if the engine dies before it has %d more tokens, it is failed", rid, st.crashes,
                       PROBATION_TOKENS)
        if await self._send_resumed(rid, st):
            return 1
        if self._isolated == rid:  # not sent: the core died meanwhile, or the request is ending here
            self._isolated = None
        if self.dead_reason is not None:
            st.suspect = True  # still a suspect: resumed alone on the next core
            return 0
        return await self._isolate_next()

    def _cleared(self, rid: str) -> None:
        """The suspect resumed alone produced its probation tokens, finished or left: resume the next one."""
        if self._isolated != rid:
            return
        self._isolated = None
        st = self.streams.get(rid)
        if st is not None:
            st.crashes = 0  # it ran alone without killing the engine: not the culprit
        if any(s.suspect for s in self.streams.values()):
            task = asyncio.get_running_loop().create_task(self._isolate_next())
            self._pending.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(self._pending.discard)

    async def _watch(self) -> None:
        """Death of the core: a socket disconnect, or its pid gone (it may die before we see the socket)."""
        pid = self.ready.pid if self.ready else 0
        while self.dead_reason is None:
            try:
                if await self.monitor.poll(LIVENESS_CHECK_S * 1000):
                    await recv_monitor_message(self.monitor)
                    await asyncio.sleep(0.2)  # a goodbye sent just before the disconnect is read first
                    self._mark_dead("the engine core closed its connection")
                    break
                if pid:
                    os.kill(pid, 0)
            except ProcessLookupError:
                self._mark_dead(f"the engine core process (pid {pid}) exited")
            except PermissionError:  # pid reused by another user's process: ours is gone
                self._mark_dead(f"the engine core process (pid {pid}) exited")

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None,
                       slo_ms: tuple[float | None, float | None] = (None, None), priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[Delta]:
        """Deltas of one engine request until it finishes; leaving early aborts it in the core."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        params = params.with_tokenizer(self.processor.tokenizer)  # bad_words -> token ids
        st = _Stream(asyncio.Queue(), len(prompt_token_ids))
        self.streams[request_id] = st
        self.processor.add(request_id, params, len(prompt_token_ids))
        if self.metrics:
            self.metrics.observe_request(params)
        if self.log_requests:
            if self.max_log_len is None:  # moeserve's default: no prompt text in the log
                logger.info("Received request %s: prompt tokens: %d, params: %s", request_id,
                            len(prompt_token_ids), _params_text(params))
            else:  # vLLM's: the prompt and its token ids, each cut to --max-log-len
                n = self.max_log_len
                shown = prompt_token_ids[:n]
                text = self.tokenizer.decode(shown)[:n] if self.tokenizer is not None else None
                logger.info("Received request %s: prompt: %r, prompt tokens: %d, params: %s, prompt_token_ids: %s",
                            request_id, text, len(prompt_token_ids), _params_text(params), shown)
        params.logprobs_mode = self.logprobs_mode  # after the log line: it is the server's, not the request's
        outcome = "abort"
        try:
            req = EngineCoreRequest(request_id, prompt_token_ids, params, self.eos_token_ids, time.time(),
                                    kv_transfer_params, *slo_ms, priority=priority, cache_salt=cache_salt,
                                    structured_grammar=structured_grammar(params))
            st.request = req
            st.on_core = True
            try:
                await self.sock.send_multipart([MSG_ADD, self.encoder.encode(req)])
            except zmq.ZMQError as e:  # the socket was replaced under us: the core died this instant
                outcome = "error"
                raise EngineDeadError(self.dead_reason or f"cannot reach the engine core ({e})") from None
            while True:
                item = await st.queue.get()
                if isinstance(item, Exception):
                    outcome = "error"
                    raise item
                yield item
                if item.finished:
                    outcome = item.finish_reason or "stop"
                    return
        finally:
            self.streams.pop(request_id, None)
            self._cleared(request_id)
            if self.processor.states.pop(request_id, None) is not None and outcome == "abort":
                self.abort_nowait([request_id])  # no await: this may run while the generator is closed
            if self.metrics:
                self.metrics.observe_finished(st, outcome)
            if self.log_requests:
                logger.info("Finished request %s: %s, prompt tokens: %d, output tokens: %d, e2e %.3f s", request_id,
                            outcome, st.prompt_len, st.num_tokens, time.perf_counter() - st.arrival)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Queue an abort (SNDHWM 0: the send never blocks, so no await is needed)."""
        if self.dead_reason is None and request_ids:
            self.sock.send_multipart([MSG_ABORT, self.encoder.encode(EngineCoreAbort(request_ids))])

    async def call_utility(self, method: str, timeout: float = 30.0):
        """Run a management call (protocol.UTILITY_CALLS) in the engine core and return its result."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._call_ids += 1
        call_id = self._call_ids
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.sock.send_multipart([MSG_UTILITY, self.encoder.encode(EngineCoreUtility(call_id, method))])
            answer = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if answer.error:
            raise EngineRequestError(answer.error, "invalid")
        return answer.result

    async def _output_loop(self) -> None:
        while True:
            kind, payload = await self.sock.recv_multipart()
            if kind == MSG_GOODBYE:
                self._core_stopping = True
                continue
            if kind == MSG_FATAL:  # the core is about to exit and says why: what requests are told when its
                self._core_fatal = payload.decode(errors="replace")  # disconnect is seen (_watch)
                continue
            if kind == MSG_UTILITY:
                answer = msgspec.msgpack.decode(payload, type=EngineCoreUtilityResult)
                fut = self._calls.get(answer.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
                continue
            if kind != MSG_OUTPUTS:
                continue
            batch = self.dec_outputs.decode(payload)
            if batch.sent_at:  # a heartbeat: the core was alive when it sent it (protocol.EngineCoreOutputs)
                self.last_heard = max(self.last_heard, min(batch.sent_at, time.monotonic()))
            if batch.stats is not None:
                self.stats = batch.stats
                if self.metrics:
                    self.metrics.set_engine_stats(batch.stats)
            aborts = []
            now = time.perf_counter()
            step_tokens = 0
            for out in batch.outputs:
                st = self.streams.get(out.request_id)
                if st is None or out.request_id not in self.processor.states:
                    continue  # finished or aborted here already
                if st.lost_at is not None:
                    self._resumed(st, out)
                if out.error:
                    self.processor.states.pop(out.request_id, None)
                    st.queue.put_nowait(EngineRequestError(out.error, out.error_kind or "invalid", out.retry_after_s))
                    reason = admission_reason(out)
                    if reason is not None and self.metrics:
                        self.metrics.admission_rejected(reason)
                    continue
                delta, hit_stop = self.processor.process(out)
                if hit_stop:
                    aborts.append(out.request_id)
                if out.request_id == self._isolated:
                    st.probation -= len(out.new_token_ids)
                    if st.probation <= 0 or out.finish_reason is not None or hit_stop:
                        self._cleared(out.request_id)
                step_tokens += self._record_timing(st, out, now)
                st.queue.put_nowait(delta)
            if self.metrics:
                self.metrics.observe_iteration(step_tokens)
            self.abort_nowait(aborts)

    def _resumed(self, st: _Stream, out) -> None:
        """The first output of a request resumed on a new core."""
        if self.metrics:
            self.metrics.observe_resumed(time.perf_counter() - st.lost_at)
        st.lost_at = None
        if st.first is not None:
            out.num_cached_tokens = 0  # the new core's cache hits cover the tokens resent: not the prompt's

    def _record_timing(self, st: _Stream, out, now: float) -> int:
        """Timings and token counts of one output; returns the tokens the step computed for it (vLLM's
        iteration tokens: the prompt's uncached tokens with its first token, then the new tokens)."""
        n = len(out.new_token_ids)
        if n == 0:
            return 0
        computed = n
        if st.first is None:
            st.first, st.num_cached, st.queue_time = now, out.num_cached_tokens, out.queue_time
            computed += st.prompt_len - out.num_cached_tokens
            if self.metrics:
                self.metrics.observe_first_token(st)
        elif self.metrics:
            self.metrics.itl.observe(now - st.last)
        st.last = now
        st.num_tokens += n
        st.num_preemptions += out.num_preemptions
        return computed
