"""The NIXL transport: one NIXL agent (UCX backend) over an engine's KV-cache tensors.

Lifecycle: the engine builds it once with its KV tensors (one per layer, [num_blocks, block_size, dim],
plus the MTP layer's); the agent registers them and listens on kv_port for peers asking for its metadata.
A decode engine loads a prefill engine's metadata once (fetch, then poll until it arrived), then posts one
READ per request: every tensor's pulled blocks into the same tensor's local blocks, one descriptor per
block and tensor, with the prefill's request id as the notification. The prefill engine reads its
notifications each step and frees the blocks named in them.

Both sides must hold the KV on the same kind of device (DRAM here; VRAM on GPUs, device 0 of each
process). Addresses come from the request's kv_transfer_params; NIXL refuses any outside the registered
regions, so a forged or stale dict fails the transfer, it cannot read other memory.
"""
from __future__ import annotations

import importlib
import logging
import time

import torch

logger = logging.getLogger(__name__)


def _nixl_api():
    """nixl's Python API: the `nixl` meta package, or a CUDA-variant wheel installed on its own."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("prefill/decode disaggregation needs NIXL: pip install nixl-cu12 (or nixl-cu13)")


REFETCH_S = 0.5  # a remote agent's metadata is asked for again this often until it arrives
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


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


class NixlConnector:
    def __init__(self, engine_id: str, tensors: list[torch.Tensor], port: int) -> None:
        assert tensors and all(t.is_contiguous() and t.shape == tensors[0].shape for t in tensors), \
            "KV tensors must be contiguous and of one shape"
        api = _nixl_api()
        self.engine_id = engine_id
        config = api.nixl_agent_config(enable_listen_thread=True, listen_port=port, backends=["UCX"])
        self.agent = _agent_with_paced_progress(api, engine_id, config)
        self.tensors = tensors
        self.agent.register_memory(tensors)
        self.mem_type, self.device_id = _mem(tensors[0])
        self.kv_addrs = [t.data_ptr() for t in tensors]
        self.block_bytes = tensors[0][0].numel() * tensors[0].element_size()
        self._loaded: dict[str, tuple[str, int]] = {}  # remote agents whose metadata arrived -> from where
        self._asked: dict[str, float] = {}  # remote agent -> when its metadata was first requested
        self._last_ask: dict[str, float] = {}  # remote agent -> when the last request for it was sent

    # ---- decode side -----------------------------------------------------------------------------
    def remote_ready(self, engine_id: str, host: str, port: int) -> bool:
        """True once the remote agent's metadata is here; the first call asks for it (non-blocking)."""
        if engine_id in self._loaded:
            return True
        now = time.monotonic()
        if engine_id not in self._asked:
            self._asked[engine_id] = now
        if now - self._last_ask.get(engine_id, 0.0) >= REFETCH_S:
            # Asked again until it answers: a request sent on a connection the peer's restart broke is lost
            # (NIXL drops that connection and the next request makes a new one).
            self.agent.fetch_remote_metadata(engine_id, host, port)
            self._last_ask[engine_id] = now
        if self.agent.check_remote_metadata(engine_id):
            self._loaded[engine_id] = (host, port)
            del self._asked[engine_id]
            self._last_ask.pop(engine_id, None)
            return True
        return False

    def knows(self, engine_id: str) -> bool:
        return engine_id in self._loaded

    def loaded_from(self, engine_id: str) -> tuple[str, int] | None:
        """(host, port) the remote agent's metadata came from, None if it is not loaded."""
        return self._loaded.get(engine_id)

    def asked_since(self, engine_id: str) -> float | None:
        return self._asked.get(engine_id)

    def forget(self, engine_id: str) -> None:
        """Ask again next time (the peer did not answer in time, or restarted). Loaded metadata is dropped
        from the agent too: NIXL keys peers by name, so a peer restarted under the same engine_id would
        otherwise be read with its previous life's metadata (every read fails) for as long as we run."""
        self._asked.pop(engine_id, None)
        self._last_ask.pop(engine_id, None)
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
