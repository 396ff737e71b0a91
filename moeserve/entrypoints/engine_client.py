"""The API server's side of the engine-core connection: asyncio over a ZMQ DEALER socket.

Lifecycle: start() says hello and waits for EngineCoreReady; then one task reads output batches,
detokenizes them (OutputProcessor: text deltas, stop strings) and feeds each request's queue, and another
watches the connection. generate() yields a request's Deltas; leaving it early (client gone, stop string)
aborts the request in the core, which frees its KV blocks. When the core dies every waiting request gets
EngineDeadError and new ones are refused at once, so nobody hangs.
"""
from __future__ import annotations

import asyncio
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
from moeserve.protocol import (MSG_ABORT, MSG_ADD, MSG_HELLO, MSG_OUTPUTS, EngineCoreAbort, EngineCoreHello,
                               EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, EngineStats)
from moeserve.sampling_params import SamplingParams
from moeserve.structured.params import structured_dfa

logger = logging.getLogger("moeserve.api")

LIVENESS_CHECK_S = 0.5


class EngineDeadError(RuntimeError):
    pass


class EngineRequestError(RuntimeError):
    """The core refused or failed a request: kind "invalid" (a 400), "overloaded" (a 503), "internal" (a 500)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Stream:
    queue: asyncio.Queue
    prompt_len: int
    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0


class EngineClient:
    def __init__(self, address: str, tokenizer, eos_token_ids: list[int], client_index: int = 0,
                 metrics=None) -> None:
        self.address = address
        self.eos_token_ids = list(eos_token_ids)
        self.client_index = client_index
        self.metrics = metrics
        self.processor = OutputProcessor(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"api-{client_index}-{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.encoder = msgspec.msgpack.Encoder()
        self.dec_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready: EngineCoreReady | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self, timeout: float = 60.0) -> None:
        await self.sock.send_multipart([MSG_HELLO, self.encoder.encode(EngineCoreHello(self.client_index))])
        while True:
            if not await self.sock.poll(timeout * 1000):
                raise EngineDeadError(f"the engine core at {self.address} did not answer within {timeout:.0f} s")
            kind, payload = await self.sock.recv_multipart()
            if kind == MSG_HELLO:
                self.ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
                break
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine core is gone: %s; answering 503 from now on", reason)
        for rid, st in list(self.streams.items()):
            st.queue.put_nowait(EngineDeadError(reason))
            self.processor.states.pop(rid, None)
        if self.metrics:
            self.metrics.engine_alive.set(0)

    async def _watch(self) -> None:
        """Death of the core: a socket disconnect, or its pid gone (it may die before we see the socket)."""
        pid = self.ready.pid if self.ready else 0
        while self.dead_reason is None:
            try:
                if await self.monitor.poll(LIVENESS_CHECK_S * 1000):
                    await recv_monitor_message(self.monitor)
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
                       kv_transfer_params: dict | None = None) -> AsyncIterator[Delta]:
        """Deltas of one engine request until it finishes; leaving early aborts it in the core."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        st = _Stream(asyncio.Queue(), len(prompt_token_ids))
        self.streams[request_id] = st
        self.processor.add(request_id, params, len(prompt_token_ids))
        outcome = "abort"
        try:
            req = EngineCoreRequest(request_id, prompt_token_ids, params, self.eos_token_ids, time.time(),
                                    kv_transfer_params, structured_dfa(params))
            await self.sock.send_multipart([MSG_ADD, self.encoder.encode(req)])
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
            if self.processor.states.pop(request_id, None) is not None and outcome == "abort":
                self.abort_nowait([request_id])  # no await: this may run while the generator is closed
            if self.metrics:
                self.metrics.observe_finished(st, outcome)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Queue an abort (SNDHWM 0: the send never blocks, so no await is needed)."""
        if self.dead_reason is None and request_ids:
            self.sock.send_multipart([MSG_ABORT, self.encoder.encode(EngineCoreAbort(request_ids))])

    async def _output_loop(self) -> None:
        while True:
            kind, payload = await self.sock.recv_multipart()
            if kind != MSG_OUTPUTS:
                continue
            batch = self.dec_outputs.decode(payload)
            if batch.stats is not None:
                self.stats = batch.stats
                if self.metrics:
                    self.metrics.set_engine_stats(batch.stats)
            aborts = []
            now = time.perf_counter()
            for out in batch.outputs:
                st = self.streams.get(out.request_id)
                if st is None or out.request_id not in self.processor.states:
                    continue  # finished or aborted here already
                if out.error:
                    self.processor.states.pop(out.request_id, None)
                    st.queue.put_nowait(EngineRequestError(out.error, out.error_kind or "invalid"))
                    continue
                delta, hit_stop = self.processor.process(out)
                if hit_stop:
                    aborts.append(out.request_id)
                self._record_timing(st, len(out.new_token_ids), now)
                st.queue.put_nowait(delta)
            self.abort_nowait(aborts)

    def _record_timing(self, st: _Stream, n: int, now: float) -> None:
        if n == 0:
            return
        if st.first is None:
            st.first = now
            if self.metrics:
                self.metrics.ttft.observe(now - st.arrival)
        elif self.metrics:
            self.metrics.itl.observe(now - st.last)
        st.last = now
        st.num_tokens += n
