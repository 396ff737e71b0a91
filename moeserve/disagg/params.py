"""kv_transfer_params: what a request says about prefill/decode disaggregation (vLLM's field and keys).

To a prefill instance:  {"do_remote_decode": true}   (the proxy also sets max_tokens 1)
                        (and the proxy's signed ticket: proxy_nonce, proxy_expires, proxy_signature)
Its answer, to forward: {"do_remote_prefill": true, "remote_engine_id": ..., "remote_host": ...,
                         "remote_port": ..., "remote_request_id": ..., "remote_block_ids": [...],
                         "remote_kv_addrs": [...], "remote_block_bytes": ..., "remote_num_tokens": ...,
                         "remote_incarnation": ..., "remote_prompt_hash": ..., "remote_expires": ...,
                         "remote_signature": ...}   (signed by the prefill instance: disagg/trust.py)
A decode instance given the answer pulls the blocks and computes only the prompt's last token itself.
When no decode instance will (it refused the request, or none could be reached), the proxy posts the answer
back to the prefill instance's /kv_transfer/release, which frees the blocks at once (held_request_id).
The values are checked here, so a malformed dict is a clear error (an HTTP 400), never a crash.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class KVTransferParamsError(ValueError):
    """kv_transfer_params that cannot be used; the message names the key."""


def _flag(d: dict, key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be true or false, got {v!r}")
    return v


def _int(d: dict, key: str, lo: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be an integer >= {lo}, got {v!r}")
    return v


def _str(d: dict, key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be a non-empty string, got {v!r}")
    return v


def _ints(d: dict, key: str) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in v):
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be a non-empty list of integers >= 0")
    return v


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance finds a prompt's KV: the prefill engine's NIXL agent and blocks."""

    engine_id: str
    host: str
    port: int
    request_id: str  # the prefill instance's id of the request (its blocks are freed by that name)
    block_ids: list[int]
    kv_addrs: list[int]  # base address of each KV tensor (one per layer) in the prefill process
    block_bytes: int  # bytes of one block in one tensor
    num_tokens: int  # prompt tokens whose KV the blocks hold
    incarnation: str = ""  # the prefill process's life (its metadata server's): a restart makes these stale


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    remote: RemotePrefill | None = None  # set when do_remote_prefill
    raw: dict = field(default_factory=dict, compare=False)  # as received: what the signature covers

    @classmethod
    def parse(cls, d: object) -> "KVTransferParams":
        if not isinstance(d, dict):
            raise KVTransferParamsError(f"kv_transfer_params must be a JSON object, got {type(d).__name__}")
        decode, prefill = _flag(d, "do_remote_decode"), _flag(d, "do_remote_prefill")
        if decode and prefill:
            raise KVTransferParamsError("kv_transfer_params: do_remote_decode (to a prefill instance) and "
                                        "do_remote_prefill (to a decode instance) exclude each other")
        if not prefill:
            return cls(do_remote_decode=decode, raw=d)
        remote = RemotePrefill(
            engine_id=_str(d, "remote_engine_id"), host=_str(d, "remote_host"), port=_int(d, "remote_port", 1),
            request_id=_str(d, "remote_request_id"), block_ids=_ints(d, "remote_block_ids"),
            kv_addrs=_ints(d, "remote_kv_addrs"), block_bytes=_int(d, "remote_block_bytes", 1),
            num_tokens=_int(d, "remote_num_tokens", 1), incarnation=_str(d, "remote_incarnation"))
        if remote.port > 65535:
            raise KVTransferParamsError(f"kv_transfer_params.remote_port must be a port number, got {remote.port}")
        return cls(remote=remote, raw=d)


def held_request_id(raw: object, secret: str) -> str:
    """The prefill instance's request id in a {"kv_transfer_params": <its signed answer>} release body."""
    from moeserve.disagg.trust import check_signature
    if not isinstance(raw, dict) or set(raw) != {"kv_transfer_params"}:
        raise KVTransferParamsError("send {\"kv_transfer_params\": {...}} with the kv_transfer_params a prefill "
                                    "answer carried")
    params = KVTransferParams.parse(raw["kv_transfer_params"])
    if params.remote is None:
        raise KVTransferParamsError("kv_transfer_params must be a prefill instance's answer (do_remote_prefill "
                                    "true, remote_request_id, ...): they name the KV to release")
    check_signature(secret, params.raw)  # a TrustError is a KVTransferParamsError
    return params.remote.request_id


def remote_prefill_dict(r: RemotePrefill) -> dict:
    """The answer of a prefill instance: the params its decode instance is given."""
    return {"do_remote_prefill": True, "remote_engine_id": r.engine_id, "remote_host": r.host,
            "remote_port": r.port, "remote_request_id": r.request_id, "remote_block_ids": list(r.block_ids),
            "remote_kv_addrs": list(r.kv_addrs), "remote_block_bytes": r.block_bytes,
            "remote_num_tokens": r.num_tokens, "remote_incarnation": r.incarnation}
