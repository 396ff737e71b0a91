"""Prefill/decode disaggregation inside one engine: a prefill instance holds finished prompts' KV for a
decode instance, which pulls it before decoding (system-brief item 1: decode pulls the KV).

Lifecycle on a prefill instance (kv_producer): a request with do_remote_decode runs as usual (the proxy
asks for one token); at its finish the scheduler keeps its blocks (KVCacheManager.hold) and the engine's
output carries export(): where the blocks are. They are freed when the decode engine's notification
arrives (its read finished, or it gave up), when the request id is aborted (release(): the proxy says the
decode instance refused the request or could not be reached, so nobody will pull them) or after
kv_hold_timeout seconds (nobody came for them).

Lifecycle on a decode instance (kv_consumer): a request with do_remote_prefill waits here, not in the
scheduler: QUEUED until the KV pool has room for its prompt -> FETCHING the prefill agent's metadata
(once per prefill engine) -> READING its blocks (only those past a prefix this engine's own prefix cache
holds, e.g. the earlier turns of a chat it decoded) -> then it enters the scheduler with num_computed_tokens
= prompt - 1: the engine computes the last prompt token itself and samples the first output token from
its logits, so a PD deployment answers what a unified engine would (vLLM's NIXL connector does the same).
A failure answers the request with an error and tells the prefill engine to free its blocks; an abort
waits for a read in flight to end before its blocks go back to the pool. A prefill engine found gone (nothing
listens at its address, it restarted, or it did not answer within METADATA_TIMEOUT_S) fails every pull
waiting on it at once.

Trust (disagg/trust.py): a prefill engine holds KV only for a request carrying the proxy's signed ticket, and
signs the params it exports; a decode engine verifies them (this deployment's, this prompt, not expired, not
used before) before it connects anywhere or reads a block.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from moeserve.config import KVTransferConfig
from moeserve.disagg import trust
from moeserve.disagg.nixl_connector import NixlConnector, RemoteUnavailable
from moeserve.disagg.params import KVTransferParams, KVTransferParamsError, RemotePrefill, remote_prefill_dict
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.protocol import EngineCoreOutput

logger = logging.getLogger(__name__)

METADATA_TIMEOUT_S = 10.0  # a prefill engine that does not answer for its metadata within this is down


@dataclass
class _Pull:
    request: Request
    remote: RemotePrefill
    num_tokens: int  # prompt tokens to pull: all but the last
    allocated: bool = False
    local_blocks: int = 0  # leading blocks this engine's prefix cache already holds: not pulled
    handle: object | None = None
    aborted: bool = False
    retried: bool = False  # a failed read is retried once with the prefill agent's metadata fetched anew
    since: float = field(default_factory=time.monotonic)


class KVTransfer:
    def __init__(self, config: KVTransferConfig, kv: KVCacheManager, tensors: list[torch.Tensor],
                 rank: int = 0, world_size: int = 1) -> None:
        """rank / world_size: this DP rank of a multi-rank engine; each rank's agent serves its own KV
        (port kv_port + rank, name engine_id-dp<rank>)."""
        self.config, self.kv = config, kv
        self.secret = trust.resolve_secret(config.kv_secret, "--kv-transfer-config")
        self.host = config.kv_host
        name = config.engine_id or f"moeserve-{uuid.uuid4().hex[:12]}"
        self.engine_id = f"{name}-dp{rank}" if world_size > 1 else name
        self.connector = NixlConnector(self.engine_id, tensors, self.host,
                                       config.kv_port + rank if config.kv_port else 0, self.secret)
        self.port = self.connector.server.address[1]
        self._tickets_used, self._params_used = trust.OnceCache(), trust.OnceCache()
        self.num_tensors = len(tensors)
        self.held_until: dict[str, float] = {}  # prefill side: request id -> when its blocks are freed anyway
        self.pulls: dict[str, _Pull] = {}  # decode side, in arrival order
        self.blocks_pulled = self.blocks_cached_here = 0  # decode side, since start
        logger.info("KV connector %s (NIXL/UCX, %s) listening on %s:%d", self.engine_id, config.kv_role,
                    self.host, self.port)

    # ---- admission -------------------------------------------------------------------------------
    def check(self, request: Request, params: KVTransferParams) -> None:
        """Raise KVTransferParamsError if this engine cannot serve the request's role."""
        if params.do_remote_decode and not self.config.produces:
            raise KVTransferParamsError("this engine is a decode instance (kv_role kv_consumer); send "
                                        "do_remote_decode requests to a prefill instance")
        if params.do_remote_decode:
            trust.check_ticket(self.secret, params.raw, self._tickets_used)
        if params.do_remote_decode and request.request_id in self.kv.held:
            # its finish would hold new blocks under the same id: the held ones would never be freed
            raise KVTransferParamsError(f"request id {request.request_id!r} is already in use: its KV waits for a "
                                        "decode instance; use a new id")
        r = params.remote
        if r is None:
            return
        if not self.config.consumes:
            raise KVTransferParamsError("this engine is a prefill instance (kv_role kv_producer); send "
                                        "do_remote_prefill requests to a decode instance")
        trust.check_params(self.secret, params.raw, request.prompt_token_ids, self._params_used)
        if r.num_tokens != request.num_prompt_tokens:
            raise KVTransferParamsError(f"kv_transfer_params were made for a prompt of {r.num_tokens} tokens; "
                                        f"this prompt has {request.num_prompt_tokens}: send the same prompt")
        if r.block_bytes != self.connector.block_bytes or len(r.kv_addrs) != self.num_tensors:
            raise KVTransferParamsError(
                f"the prefill engine's KV layout ({len(r.kv_addrs)} tensors, {r.block_bytes} bytes per block) "
                f"differs from this engine's ({self.num_tensors}, {self.connector.block_bytes}): run both with "
                "the same model, dtype, --kv-cache-dtype, --block-size and --speculative-config")
        if len(r.block_ids) < self.kv.blocks_needed(r.num_tokens - 1):
            raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has {len(r.block_ids)} blocks, "
                                        f"too few for {r.num_tokens - 1} tokens")
        if request.request_id in self.pulls:
            raise KVTransferParamsError(f"request id {request.request_id!r} is already in use")

    def add_pull(self, request: Request, remote: RemotePrefill) -> None:
        self.pulls[request.request_id] = _Pull(request, remote, remote.num_tokens - 1)

    def export(self, request: Request) -> dict:
        """A finished do_remote_decode request: its held blocks, as the decode instance's params."""
        self.held_until[request.request_id] = time.monotonic() + self.config.kv_hold_timeout
        params = remote_prefill_dict(RemotePrefill(
            self.engine_id, self.host, self.port, request.request_id, list(self.kv.held[request.request_id]),
            list(self.connector.kv_addrs), self.connector.block_bytes, request.num_prompt_tokens,
            self.connector.incarnation))
        return trust.sign_params(self.secret, params, request.prompt_token_ids, self.config.kv_hold_timeout)

    def abort(self, request_id: str) -> bool:
        """True if the request was one of our pulls (it is dropped; a read in flight ends first)."""
        pull = self.pulls.get(request_id)
        if pull is None:
            return False
        pull.aborted = True
        if pull.handle is None:
            self._drop(pull)
        return True

    def release(self, request_id: str) -> bool:
        """True if the request's blocks were held for a decode instance: they are freed now (nobody will
        pull them; waiting for kv_hold_timeout would keep a prompt's KV out of use for minutes)."""
        if self.held_until.pop(request_id, None) is None:
            return False
        self.kv.release_held(request_id)
        return True

    # ---- each step -------------------------------------------------------------------------------
    def poll(self) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Free pulled (or expired) held blocks; advance pulls. Returns (requests whose KV arrived, errors)."""
        self._release_held()
        ready, errors = [], []
        room = True  # pulls get blocks in arrival order
        for pull in list(self.pulls.values()):
            if self.pulls.get(pull.request.request_id) is not pull:
                continue  # failed meanwhile with others waiting on the same prefill engine
            if pull.handle is not None:
                self._check_read(pull, ready, errors)
                continue
            if not pull.allocated:
                if not room or not self._allocate(pull):
                    room = False
                    continue
                pull.allocated = True
            self._start_read(pull, ready, errors)
        return ready, errors

    def _allocate(self, pull: _Pull) -> bool:
        """Blocks for the prompt; a prefix this engine has cached (an earlier turn of the conversation
        decoded here) is shared, not pulled, as vLLM's NIXL connector does."""
        req = pull.request
        cached = self.kv.take_cached_prefix(req)
        if self.kv.allocate_slots(req, pull.num_tokens + 1 - req.num_computed_tokens):
            pull.local_blocks = cached // self.kv.block_size
            return True
        if cached:  # not this step after all: give the shared blocks back
            self.kv.untake(req)
        return False

    def _start_read(self, pull: _Pull, ready: list[Request], errors: list[EngineCoreOutput]) -> None:
        r = pull.remote
        try:
            if not self._metadata_ready(pull, errors):
                return
            n, k = self.kv.blocks_needed(pull.num_tokens), pull.local_blocks
            if k >= n:  # nothing to pull (a one-token prompt, or all cached here): the prefill may free it now
                self.connector.notify(r.engine_id, r.request_id.encode())
                self._finish_pull(pull, ready)
                return
            local = self.kv.block_tables[pull.request.request_id][k:n]
            pull.handle = self.connector.read(r.engine_id, r.kv_addrs, r.block_ids[k:n], local,
                                              r.request_id.encode())
            self.blocks_pulled += n - k
            self.blocks_cached_here += k
        except Exception as e:  # NIXL refuses bad addresses / unreachable peers with exceptions
            self._retry_or_fail(pull, errors, f"the KV pull from {r.engine_id} failed: {e}")

    def _metadata_ready(self, pull: _Pull, errors: list[EngineCoreOutput]) -> bool:
        """The prefill agent's metadata, of the life of that process which signed the params, is loaded."""
        r = pull.remote
        where = self.connector.loaded_from(r.engine_id)
        if where is not None and where != (r.host, r.port, r.incarnation):
            # The name now lives elsewhere or in a new process (a prefill instance restarted, or two share an
            # engine_id): its old metadata would read the wrong process. Fetch it anew once our reads from
            # the old one have ended.
            if self._reading_from(r.engine_id):
                return False
            self.connector.forget(r.engine_id)
        try:
            if not self.connector.remote_ready(r.engine_id, r.host, r.port):
                asked = self.connector.asked_since(r.engine_id)
                if asked is None or time.monotonic() - asked <= METADATA_TIMEOUT_S:
                    return False
                message = f"did not answer within {METADATA_TIMEOUT_S:.0f} s"
                self.connector.forget(r.engine_id)
            elif self.connector.loaded_from(r.engine_id)[2] != r.incarnation:
                self._fail_waiting_on(r, errors, f"the prefill engine {r.engine_id} at {r.host}:{r.port} restarted "
                                                 "since it answered: the KV it named is gone", same_life=True)
                return False
            else:
                return True
        except RemoteUnavailable as e:
            if not e.definitive:
                return False  # retried until METADATA_TIMEOUT_S
            message = str(e)
        self._fail_waiting_on(r, errors, f"the prefill engine {r.engine_id} at {r.host}:{r.port}: {message}")
        return False

    def _fail_waiting_on(self, remote: RemotePrefill, errors: list[EngineCoreOutput], message: str,
                         same_life: bool = False) -> None:
        """Every pull still waiting for that prefill engine (or, same_life, that life of it) fails now, not
        each after a timeout of its own."""
        for pull in list(self.pulls.values()):
            r = pull.remote
            if pull.handle is None and (r.engine_id, r.host, r.port) == (remote.engine_id, remote.host, remote.port) \
                    and (not same_life or r.incarnation == remote.incarnation):
                self._fail(pull, errors, message)

    def _check_read(self, pull: _Pull, ready: list[Request], errors: list[EngineCoreOutput]) -> None:
        state = self.connector.state(pull.handle)
        if state == "PROC":
            return
        pull.handle.release()
        pull.handle = None
        if state == "ERR":
            self._retry_or_fail(pull, errors, f"the KV read from {pull.remote.engine_id} failed")
        elif pull.aborted:
            self._drop(pull)
        else:
            self._finish_pull(pull, ready)

    def _finish_pull(self, pull: _Pull, ready: list[Request]) -> None:
        del self.pulls[pull.request.request_id]
        pull.request.num_computed_tokens = pull.num_tokens
        ready.append(pull.request)

    def _reading_from(self, engine_id: str) -> bool:
        return any(p.handle is not None and p.remote.engine_id == engine_id for p in self.pulls.values())

    def _retry_or_fail(self, pull: _Pull, errors: list[EngineCoreOutput], message: str) -> None:
        """A read failed. If it used metadata loaded earlier, the prefill instance may have restarted under
        the same engine_id and port: drop that metadata and try once more with a fresh copy (the blocks stay
        allocated). Metadata still in use by other reads is kept (dropping it would fail them)."""
        r = pull.remote
        if pull.aborted or pull.retried or not self.connector.knows(r.engine_id) or self._reading_from(r.engine_id):
            self._fail(pull, errors, message)
            return
        logger.info("request %s: %s; fetching %s's metadata again and retrying", pull.request.request_id,
                    message, r.engine_id)
        pull.retried = True
        self.connector.forget(r.engine_id)

    def _fail(self, pull: _Pull, errors: list[EngineCoreOutput], message: str) -> None:
        logger.warning("request %s: %s", pull.request.request_id, message)
        if not pull.aborted:
            errors.append(EngineCoreOutput(pull.request.request_id, [], finish_reason="abort", error=message,
                                           error_kind="kv_transfer"))
        self._drop(pull)

    def _drop(self, pull: _Pull) -> None:
        self.pulls.pop(pull.request.request_id, None)
        self.kv.free(pull.request)
        if self.connector.knows(pull.remote.engine_id):  # reachable: let it free its blocks now
            self.connector.notify(pull.remote.engine_id, pull.remote.request_id.encode())

    def _release_held(self) -> None:
        for msg in self.connector.notifications():
            rid = msg.decode(errors="replace")
            if self.held_until.pop(rid, None) is not None:
                self.kv.release_held(rid)
        now = time.monotonic()
        for rid in [r for r, t in self.held_until.items() if t < now]:
            logger.warning("request %s: no decode engine pulled its KV within %.0f s; freeing its blocks",
                           rid, self.config.kv_hold_timeout)
            del self.held_until[rid]
            self.kv.release_held(rid)

    # ---- introspection ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Pulls to advance (the engine must keep stepping)."""
        return bool(self.pulls)

    @property
    def num_held(self) -> int:
        return len(self.held_until)
