"""NIXL agent metadata over an authenticated TCP exchange bound to kv_host (not NIXL's own listener).

NIXL's listener thread binds every interface and hands its agent's metadata (the keys to every registered
KV byte) to anyone who names the agent. Instead each engine serves its metadata here, on kv_host:kv_port:

  asker  -> server: MAGIC, nonce (16 bytes), wall time (8 bytes, ms), HMAC(secret, "ask", nonce, time)
  server -> asker:  length (4 bytes), metadata, incarnation (16 bytes), HMAC(secret, "meta", nonce, metadata,
                    incarnation)

A request without the deployment's MAC, or older than ASK_WINDOW_S, is dropped unanswered; an answer without
it is discarded, so neither side trusts the network. `incarnation` is fresh per process: params signed by a
previous life of a prefill instance (same name and port) are recognised as stale.
Lifecycle: MetadataServer starts with the engine's connector and serves on its own threads until close();
fetch() runs on a worker thread of the decode engine (the engine loop never blocks on a peer).
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import socketserver
import struct
import threading
import time

from moeserve.disagg.trust import mac

logger = logging.getLogger(__name__)

MAGIC = b"MOESERVE-KVMD1"
ASK_WINDOW_S = 60.0  # an ask whose timestamp is further off than this is refused (replays, skewed clocks)
IO_TIMEOUT_S = 5.0
MAX_METADATA_BYTES = 64 << 20
_ASK = struct.Struct(f"!{len(MAGIC)}s16sQ32s")


class MetadataServer:
    def __init__(self, host: str, port: int, secret: str, metadata: bytes) -> None:
        self.incarnation = os.urandom(16)
        secret_, meta, incarnation = secret, metadata, self.incarnation

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(IO_TIMEOUT_S)
                try:
                    ask = _recv_exact(self.request, _ASK.size)
                except OSError:
                    return
                magic, nonce, ms, tag = _ASK.unpack(ask)
                ok = magic == MAGIC and hmac.compare_digest(tag, mac(secret_, b"ask", nonce, ms.to_bytes(8, "big")))
                if not ok or abs(time.time() - ms / 1000) > ASK_WINDOW_S:
                    logger.warning("refused a KV metadata request from %s: not signed by this deployment",
                                   self.client_address[0])
                    return
                answer = mac(secret_, b"meta", nonce, meta, incarnation)
                try:
                    self.request.sendall(struct.pack("!I", len(meta)) + meta + incarnation + answer)
                except OSError:
                    pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("Server", (socketserver.ThreadingTCPServer,),
                          {"address_family": family, "allow_reuse_address": True, "daemon_threads": True})
        self.server = server_cls((host, port), Handler)
        self.address = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True, name="kv-metadata")
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MetadataRefused(ConnectionError):
    """Nothing listens at the peer's address: the prefill process is gone (or not up yet)."""


def fetch(host: str, port: int, secret: str, timeout: float | None = None) -> tuple[bytes, bytes]:
    """(metadata, incarnation) of the engine at host:port; raises OSError / ValueError when it cannot be had."""
    timeout = IO_TIMEOUT_S if timeout is None else timeout
    nonce, ms = os.urandom(16), int(time.time() * 1000)
    ask = _ASK.pack(MAGIC, nonce, ms, mac(secret, b"ask", nonce, ms.to_bytes(8, "big")))
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError as e:
        raise MetadataRefused(str(e)) from None
    with conn:
        conn.settimeout(timeout)
        conn.sendall(ask)
        (size,) = struct.unpack("!I", _recv_exact(conn, 4))
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"the peer at {host}:{port} announced {size} bytes of metadata")
        rest = _recv_exact(conn, size + 16 + 32)
    meta, incarnation, tag = rest[:size], rest[size:size + 16], rest[size + 16:]
    if not hmac.compare_digest(tag, mac(secret, b"meta", nonce, meta, incarnation)):
        raise ValueError(f"the peer at {host}:{port} answered without this deployment's signature")
    return meta, incarnation


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
