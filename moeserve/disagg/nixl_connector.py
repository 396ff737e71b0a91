"""The NIXL transport: one NIXL agent (UCX backend) over an engine's KV-cache tensors.

Lifecycle: the engine builds it once with its KV tensors (one per layer, [num_blocks, block_size, dim],
plus the MTP layer's); the agent registers them, and a MetadataServer (disagg/metadata.py) hands its metadata
to peers of this deployment on kv_host:kv_port (NIXL's own listener, which binds every interface and answers
anyone, is off; UCX is pinned to kv_host's interface). A decode engine loads a prefill engine's metadata once
(fetched on a worker thread; the engine polls until it arrived), then posts one
READ per request: every tensor's pulled blocks into the same tensor's local blocks, one descriptor per
block and tensor, with the prefill's request id as the notification. The prefill engine reads its
notifications each step and frees the blocks named in them.

Both sides must hold the KV on the same kind of device (DRAM here; VRAM on GPUs, device 0 of each
process). Addresses come from the request's kv_transfer_params, which the decode engine verified (signed by a
prefill instance of this deployment, disagg/trust.py); NIXL also refuses any outside the registered regions.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import logging
import os
import time
import weakref

import torch

from moeserve import netif
from moeserve.disagg.metadata import MetadataRefused, MetadataServer, fetch

logger = logging.getLogger(__name__)


def _nixl_api():
    """nixl's Python API: the `nixl` meta package, or a CUDA-variant wheel installed on its own."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("prefill/decode disaggregation needs NIXL: pip install nixl-cu12 (or nixl-cu13)")


REFETCH_S = 0.5  # a failed metadata fetch is tried again after this long (until METADATA_TIMEOUT_S)
PROGRESS_DELAY_US = 1000  # the NIXL progress thread's pause between rounds


def _agent_with_paced_progress(api, name: str, config):
    """A nixl_agent whose progress thread pauses PROGRESS_DELAY_US between rounds.

    nixl_agent hard-codes a pause of 0: its progress thread spins a core at 100% while the engine is idle
    (measured here: 2.97 s of CPU in 3 s), which on a small machine takes a core from the model. Paced at
    1 ms it used 0.09 s in 3 s and a 4 MB read still took ~1 ms. Without the thread nothing progresses while
    the engine computes (a peer's read would wait for the end of our step). The setting is the agent
    config's own field; only the wrapper's fixed value is overridden, for the constructor call alone."""
    base = api.nixlBind.nixlAgentConfig

    class PacedConfig(base):
        pthrDelay = property(base.pthrDelay.__get__,
                             lambda self, v: base.pthrDelay.__set__(self, max(v, PROGRESS_DELAY_US)))

    api.nixlBind.nixlAgentConfig = PacedConfig
    try:
        return api.nixl_agent(name, config)
    finally:
        api.nixlBind.nixlAgentConfig = base


@contextlib.contextmanager
def _ucx_pinned_to(host: str):
    """UCX listens on every network device it finds: pin it to the interface of the host we advertise (lo
    for loopback; RDMA ports stay usable), unless UCX_NET_DEVICES is set already or the host is a wildcard."""
    if "UCX_NET_DEVICES" in os.environ or netif.is_wildcard(host):
        yield
        return
    iface = netif.interface_of(host)
    if iface is None:
        raise RuntimeError(f"--kv-transfer-config kv_host {host!r} is not an address of this machine; set it to "
                           "one (the address peers reach this engine at)")
    os.environ["UCX_NET_DEVICES"] = ",".join([iface] + netif.rdma_devices())
    try:
        yield
    finally:
        del os.environ["UCX_NET_DEVICES"]


def _close(server: MetadataServer, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    server.close()
    pool.shutdown(wait=False, cancel_futures=True)


class RemoteUnavailable(RuntimeError):
    """The remote agent's metadata cannot be had; `definitive`: asking again will not help."""

    def __init__(self, message: str, definitive: bool) -> None:
        super().__init__(message)
        self.definitive = definitive


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


class NixlConnector:
    def __init__(self, engine_id: str, tensors: list[torch.Tensor], host: str, port: int, secret: str) -> None:
        assert tensors and all(t.is_contiguous() and t.shape == tensors[0].shape for t in tensors), \
            "KV tensors must be contiguous and of one shape"
        api = _nixl_api()
        self.engine_id, self.secret = engine_id, secret
        config = api.nixl_agent_config(enable_listen_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        with _ucx_pinned_to(host):
            self.agent = _agent_with_paced_progress(api, engine_id, config)
        self.tensors = tensors
        self.agent.register_memory(tensors)
        self.mem_type, self.device_id = _mem(tensors[0])
        self.kv_addrs = [t.data_ptr() for t in tensors]
        self.block_bytes = tensors[0][0].numel() * tensors[0].element_size()
        self.server = MetadataServer(host, port, secret, self.agent.get_agent_metadata())
        self.incarnation = self.server.incarnation.hex()
        self._loaded: dict[str, tuple[str, int, str]] = {}  # remote agents loaded -> (host, port, incarnation)
        self._asked: dict[str, float] = {}  # remote agent -> when its metadata was first asked for
        self._fetching: dict[str, tuple[concurrent.futures.Future, str, int]] = {}
        self._retry_at: dict[str, float] = {}  # remote agent -> when a failed fetch is tried again
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-metadata-fetch")
        # the server's threads do not hold this object: its port is freed when the engine goes away
        self.close = weakref.finalize(self, _close, self.server, self._pool)

    # ---- decode side -----------------------------------------------------------------------------
    def remote_ready(self, engine_id: str, host: str, port: int) -> bool:
        """True once the remote agent's metadata is here; the first call starts fetching it (never blocks).
        Raises RemoteUnavailable when a fetch failed: definitive when nothing listens there (the process is
        gone) or the answer is not this deployment's / not that agent; otherwise it is retried."""
        if engine_id in self._loaded:
            return True
        now = time.monotonic()
        self._asked.setdefault(engine_id, now)
        job = self._fetching.get(engine_id)
        if job is None:
            if now < self._retry_at.get(engine_id, 0.0):
                return False
            self._fetching[engine_id] = (self._pool.submit(fetch, host, port, self.secret), host, port)
            return False
        future, host, port = job
        if not future.done():
            return False
        del self._fetching[engine_id]
        try:
            meta, incarnation = future.result()
            name = self.agent.add_remote_agent(meta)
        except MetadataRefused as e:
            raise RemoteUnavailable(f"nothing listens at {host}:{port} ({e}): the prefill process is gone",
                                    definitive=True) from None
        except ValueError as e:  # a peer without our secret, or malformed metadata
            raise RemoteUnavailable(str(e), definitive=True) from None
        except Exception as e:  # a timeout, a reset: try again soon
            self._retry_at[engine_id] = now + REFETCH_S
            raise RemoteUnavailable(f"{type(e).__name__}: {e}", definitive=False) from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != engine_id:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
            raise RemoteUnavailable(f"the agent at {host}:{port} is {name!r}, not {engine_id!r}", definitive=True)
        self._loaded[engine_id] = (host, port, incarnation.hex())
        self._asked.pop(engine_id, None)
        self._retry_at.pop(engine_id, None)
        return True

    def knows(self, engine_id: str) -> bool:
        return engine_id in self._loaded

    def loaded_from(self, engine_id: str) -> tuple[str, int, str] | None:
        """(host, port, incarnation) the remote agent's metadata came from, None if it is not loaded."""
        return self._loaded.get(engine_id)

    def asked_since(self, engine_id: str) -> float | None:
        return self._asked.get(engine_id)

    def forget(self, engine_id: str) -> None:
        """Ask again next time (the peer did not answer in time, or restarted). Loaded metadata is dropped
        from the agent too: NIXL keys peers by name, so a peer restarted under the same engine_id would
        otherwise be read with its previous life's metadata (every read fails) for as long as we run."""
        self._asked.pop(engine_id, None)
        self._retry_at.pop(engine_id, None)
        job = self._fetching.pop(engine_id, None)
        if job is not None:
            job[0].cancel()
        if self._loaded.pop(engine_id, None) is not None:
            try:
                self.agent.remove_remote_agent(engine_id)
            except Exception as e:  # already gone: nothing to drop
                logger.debug("could not drop the metadata of %s: %s", engine_id, e)

    def read(self, engine_id: str, kv_addrs: list[int], remote_blocks: list[int], local_blocks: list[int],
             notif: bytes):
        """Post the READ of remote_blocks (in every remote tensor) into local_blocks; returns the handle."""
        bb = self.block_bytes
        local = [(a + b * bb, bb, self.device_id) for a in self.kv_addrs for b in local_blocks]
        remote = [(a + b * bb, bb, self.device_id) for a in kv_addrs for b in remote_blocks]
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                            self.agent.get_xfer_descs(remote, self.mem_type), engine_id, notif)
        if self.agent.transfer(handle) == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL could not post the KV read from {engine_id}")
        return handle

    def state(self, handle) -> str:
        """"DONE", "PROC" or "ERR"."""
        return self.agent.check_xfer_state(handle)

    def notify(self, engine_id: str, message: bytes) -> None:
        """Tell a prefill engine its blocks are no longer wanted (a pull that failed or was aborted)."""
        try:
            self.agent.send_notif(engine_id, message)
        except Exception as e:  # best effort: the prefill side frees them at its hold timeout anyway
            logger.warning("could not notify %s: %s", engine_id, e)

    # ---- prefill side ----------------------------------------------------------------------------
    def notifications(self) -> list[bytes]:
        """Messages from decode engines since the last call (each a prefill request id whose KV was pulled)."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
