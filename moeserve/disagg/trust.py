"""The PD trust boundary: what proves a message came from this deployment (docs/disaggregation.md, "Trust").

Every process of a PD deployment (the proxy, prefill and decode instances, all their DP ranks) shares one
secret: --kv-transfer-config "kv_secret" or $MOESERVE_KV_SECRET. With it
- the proxy signs a one-use ticket into each {"do_remote_decode": true}: a prefill instance holds KV only for
  the proxy, not for whoever reaches its HTTP port (held KV would otherwise fill its pool for kv_hold_timeout);
- a prefill instance signs the kv_transfer_params it answers with, over every key, a hash of the request's
  prompt token ids and an expiry: a decode instance connects to a host, reads blocks or asks for metadata only
  for params it can verify and for the prompt they were made for, and uses each at most once;
- /kv_transfer/release frees only what a signed prefill answer names;
- the NIXL metadata exchange (disagg/metadata.py) is MACed both ways: an agent without the secret gets no
  metadata, so it cannot address any registered KV.
HMAC-SHA256 (stdlib hmac), compared in constant time. Expiries are wall-clock times: the deployment's hosts
need clocks in step to within the hold timeout.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time

from moeserve.disagg.params import KVTransferParamsError

SECRET_ENV = "MOESERVE_KV_SECRET"
MIN_SECRET_CHARS = 16
TICKET_TTL_S = 300.0  # a proxy ticket older than this is refused (the proxy's --timeout bounds its use)
SIGNATURE_KEY = "remote_signature"
TICKET_KEYS = ("proxy_nonce", "proxy_expires", "proxy_signature")


class TrustError(KVTransferParamsError):
    """A message that does not prove it came from this deployment; the text says what is wrong."""


def resolve_secret(value: str | None, where: str) -> str:
    """The deployment secret: `value` (a flag or config key) or $MOESERVE_KV_SECRET; an error names both."""
    secret = value if value is not None else os.environ.get(SECRET_ENV)
    if not secret:
        raise TrustError(f"{where} needs the deployment's shared secret: set {SECRET_ENV} (or the "
                         f"--kv-transfer-config key kv_secret) to the same random string of >= {MIN_SECRET_CHARS} "
                         f"characters on the proxy and every instance, e.g. `export {SECRET_ENV}=$(openssl rand "
                         "-hex 32)`")
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        raise TrustError(f"the deployment secret ({SECRET_ENV} / kv_secret) must be a string of >= "
                         f"{MIN_SECRET_CHARS} characters")
    return secret


def mac(secret: str, purpose: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of length-prefixed parts under a purpose label (a MAC made for one use is no other's)."""
    h = hmac.new(secret.encode(), purpose, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big") + p)
    return h.digest()


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(b",".join(str(t).encode() for t in token_ids)).hexdigest()


# ---- proxy -> prefill: a ticket to hold KV --------------------------------------------------------------
def ticket(secret: str, ttl: float = TICKET_TTL_S) -> dict:
    """The proxy's kv_transfer_params for a prefill instance: do_remote_decode and a signed one-use nonce."""
    nonce, expires = secrets.token_hex(16), round(time.time() + ttl, 3)
    sig = mac(secret, b"ticket", nonce.encode(), repr(expires).encode()).hex()
    return {"do_remote_decode": True, "proxy_nonce": nonce, "proxy_expires": expires, "proxy_signature": sig}


def check_ticket(secret: str, raw: dict, seen: "OnceCache") -> None:
    nonce, expires, sig = (raw.get(k) for k in TICKET_KEYS)
    if not (isinstance(nonce, str) and isinstance(expires, (int, float)) and isinstance(sig, str)):
        raise TrustError("kv_transfer_params.do_remote_decode is honoured only for `moeserve proxy` of this "
                         "deployment (its ticket is missing): send requests through the proxy")
    want = mac(secret, b"ticket", nonce.encode(), repr(expires).encode()).hex()
    if not hmac.compare_digest(want, sig):
        raise TrustError("kv_transfer_params carry a proxy ticket this deployment did not sign (another "
                         "deployment's secret?)")
    if expires < time.time():
        raise TrustError("kv_transfer_params carry an expired proxy ticket")
    if not seen.add(nonce, expires):
        raise TrustError("kv_transfer_params carry a proxy ticket that was used already")


# ---- prefill -> decode: signed KV location ---------------------------------------------------------------
def sign_params(secret: str, params: dict, token_ids: list[int], ttl: float) -> dict:
    """The prefill answer's params, bound to the prompt and an expiry, signed."""
    out = {**params, "remote_prompt_hash": prompt_hash(token_ids), "remote_expires": round(time.time() + ttl, 3)}
    out[SIGNATURE_KEY] = mac(secret, b"params", _canonical(out)).hex()
    return out


def check_signature(secret: str, raw: dict) -> None:
    """The params are a prefill answer of this deployment, unaltered and not expired."""
    sig = raw.get(SIGNATURE_KEY)
    if not isinstance(sig, str):
        raise TrustError("kv_transfer_params.remote_signature is missing: do_remote_prefill params are honoured "
                         "only as a prefill instance of this deployment answered them (through the proxy)")
    body = {k: v for k, v in raw.items() if k != SIGNATURE_KEY}
    if not hmac.compare_digest(mac(secret, b"params", _canonical(body)).hex(), sig):
        raise TrustError("kv_transfer_params do not carry this deployment's signature (altered, or signed with "
                         "another secret)")
    expires = raw.get("remote_expires")
    if not isinstance(expires, (int, float)) or expires < time.time():
        raise TrustError("kv_transfer_params have expired: the prefill instance no longer holds that KV")


def check_params(secret: str, raw: dict, token_ids: list[int], seen: "OnceCache") -> None:
    """Signed, for this prompt, and not used before here."""
    check_signature(secret, raw)
    if raw.get("remote_prompt_hash") != prompt_hash(token_ids):
        raise TrustError("kv_transfer_params were made for another prompt: send the prompt the prefill "
                         "instance answered")
    if not seen.add(raw[SIGNATURE_KEY], raw["remote_expires"]):
        raise TrustError("kv_transfer_params were used already: each prefill answer serves one decode request")


class OnceCache:
    """Tokens seen, each until its expiry (a replayed ticket or params is refused while it is still valid)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def add(self, token: str, expires: float) -> bool:
        now = time.time()
        if len(self._until) > 1024:
            self._until = {t: e for t, e in self._until.items() if e >= now}
        if token in self._until:
            return False
        self._until[token] = expires
        return True
