"""`moeserve proxy`: one OpenAI endpoint in front of prefill and decode instances (system-brief item 1).

Lifecycle of a request: pick the prefill instance with the shortest estimated TTFT (the prompt characters
in flight there, less the part of this prompt it computed before and likely still caches) -> send it the
request with stream false and kv_transfer_params {"do_remote_decode": true} (it generates one token) -> its
answer says where the prompt's KV waits -> send the
original request with that kv_transfer_params to the decode instance with the least active tokens (prompt
+ max_tokens of the requests in flight there) -> relay the decode answer (JSON or SSE) unchanged. The
decode instance pulls the KV itself over NIXL; the proxy moves only JSON.

An instance's error reaches the client with its status and OpenAI body; an unreachable instance is a 503
naming it; a client that goes away closes the decode stream, which aborts the request there. When the
decode instance refuses the request (any error status: overloaded, another --max-model-len, ...) or none
can be connected to, nobody will pull the prompt's KV: the proxy posts the prefill answer's
kv_transfer_params to that prefill instance's /kv_transfer/release, which frees them now instead of at its
kv_hold_timeout.

Trust (disagg/trust.py): clients authenticate to the proxy with its own --api-key (checked with the body
limit, --max-request-body-size, for every route but /health: entrypoints/http_guard.py); the proxy talks to the
instances with the deployment's key (--instance-api-key), never the client's, and signs a one-use ticket into
each prefill request with the deployment secret. Health: every HEALTH_INTERVAL_S the proxy asks each
instance's /health (which answers 503 when its engine is dead); an instance that fails it, or answers a request
with engine_dead, takes requests only when no healthy one of its role is left.

SLO-aware admission: a prefill instance that turns the request away (503 with Retry-After: its admission
predicts the request's TTFT target cannot be met there) passes it to the next instance in preference order;
when every one does, the client gets the last 503 with its Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.config import DEFAULT_MAX_REQUEST_BODY
from moeserve.disagg import trust
from moeserve.entrypoints.http_guard import RequestGuard
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import parse_json
from moeserve.prefix_memory import PrefixMemory

logger = logging.getLogger("moeserve.proxy")

RELEASE_TIMEOUT_S = 10.0  # a release the prefill instance does not answer in time is left to its kv_hold_timeout
DISCONNECT_POLL_S = 0.25  # how often the proxy checks that a client waiting for its answer is still there
DOWN_S = 5.0  # an instance that refused a connection is tried after the others for this long
PREFIX_CHUNK_CHARS = 256  # prompt text is remembered per prefill instance in chunks of this many characters
MAX_PREFIX_CHUNKS = 1 << 16  # chunks remembered per instance (an LRU: an estimate of its prefix cache)
HEALTH_INTERVAL_S = 1.0  # how often each instance's /health is asked
HEALTH_TIMEOUT_S = 2.0  # a /health that takes longer counts as failed


@dataclass
class Upstream:
    url: str
    load: int = 0  # prefill: prompt characters in flight; decode: active tokens in flight
    down_until: float = 0.0  # monotonic time until which a connection failure puts it last
    healthy: bool = True  # its last /health answered 200 (its engine is alive)
    # prefill: hashes of the prompt chunks sent here
    prefixes: PrefixMemory = field(default_factory=lambda: PrefixMemory(MAX_PREFIX_CHUNKS))

    def matched_chars(self, hashes: list[bytes]) -> int:
        return self.prefixes.matched(hashes) * PREFIX_CHUNK_CHARS

    def remember(self, hashes: list[bytes]) -> None:
        self.prefixes.remember(hashes)


def prefix_hashes(prompt_text: str) -> list[bytes]:
    """Chained digests of the prompt text's whole chunks: equal leading digests, equal prompt prefix."""
    out, parent = [], b""
    for i in range(len(prompt_text) // PREFIX_CHUNK_CHARS):
        chunk = prompt_text[i * PREFIX_CHUNK_CHARS:(i + 1) * PREFIX_CHUNK_CHARS].encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


def by_preference(pool: list[Upstream], hashes: list[bytes] = ()) -> list[Upstream]:
    """Instances to try in order: those not recently unreachable first, then the shortest estimated TTFT
    (ties: the first listed): the work in flight there, less the prompt prefix it has computed before (its
    prefix cache holds it: the next turn of a chat goes back to the instance that has its history). An
    unreachable instance must not take every request while it is the least loaded."""
    now = time.monotonic()
    return sorted(pool, key=lambda u: (not u.healthy or u.down_until > now, u.load - u.matched_chars(hashes)))


def _turned_away(answer) -> bool:
    """A 503 with Retry-After: the instance's SLO-aware admission (engine/slo.py) turned the request away
    because it predicts the request's TTFT target would be missed there; another instance may meet it."""
    return isinstance(answer, Response) and answer.status_code == 503 and "retry-after" in answer.headers


def _prefill_body(body: dict, secret: str) -> dict:
    """The prefill instance's copy: no streaming, KV kept for a decode instance. max_tokens, min_tokens and
    the rest stay as the client sent them, so the prefill instance refuses what the decode instance would
    (a prompt + max_tokens over the context, say) before it computes and holds KV nobody will pull; with
    do_remote_decode it generates one token whatever max_tokens says (serving.py)."""
    pre = copy.deepcopy(body)
    if body.get("stream") is True:
        pre.pop("stream_options", None)  # else kept: the prefill refuses stream_options without stream
    if body.get("stream") in (None, True, False):  # anything else: the prefill refuses it as the decode would
        pre["stream"] = False
    pre["kv_transfer_params"] = trust.ticket(secret)  # do_remote_decode, signed: only the proxy may ask it
    return pre


def _count(value) -> int:
    """A token count from JSON for load accounting; anything else counts 0 (the instance judges it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _prompt_text(body: dict) -> str:
    return json.dumps(body.get("prompt", body.get("messages", "")), ensure_ascii=False)


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(message, status, param, code).body(), status_code=status)


def _unreachable(role: str, urls: list[str]) -> JSONResponse:
    return _error(f"the {role} instance{'s' if len(urls) > 1 else ''} {', '.join(urls)} "
                  f"{'are' if len(urls) > 1 else 'is'} unreachable (connection refused or failed, or the engine "
                  f"is down); check that "
                  f"{'they run' if len(urls) > 1 else 'it runs'} and that the proxy's --{role} URL is right", 503,
                  code="upstream_unavailable")


def _engine_dead(status: int, content: bytes) -> bool:
    """An instance's answer saying its engine is down (api_server.check_engine): it did no work."""
    if status != 503:
        return False
    try:
        return json.loads(content)["error"]["code"] == "engine_dead"
    except (ValueError, KeyError, TypeError):
        return False


def _cached_tokens(usage) -> int | None:
    """Prompt tokens the prefill instance's prefix cache served (its answer's usage), if it says."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _patch_usage(content: bytes, cached: int | None) -> bytes:
    """A decode answer's usage counts the decode instance's cache hits; the client's prompt was computed
    (or found cached) by the prefill instance, so report that instead."""
    if cached is None:
        return content
    try:
        body = json.loads(content)
    except ValueError:
        return content
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return content
    usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached}
    return json.dumps(body).encode()


_USAGE = re.compile(rb'"usage":\s*\{')


def _patch_event(event: bytes, cached: int | None) -> bytes:
    """One SSE event: the usage chunk (stream_options.include_usage) gets _patch_usage."""
    if cached is None or not event.startswith(b"data: {") or not _USAGE.search(event):
        return event
    return b"data: " + _patch_usage(event[len(b"data: "):], cached)


def parse_body(data: bytes):
    """The request's JSON, or the 400 to answer: the API server's bounded parser (openai_protocol.parse_json:
    not JSON, nested too deep, NaN / Infinity or a number beyond the float range such as 1e999, which would
    also fail re-encoding for the instances)."""
    try:
        return parse_json(data)
    except APIError as e:
        return JSONResponse(e.body(), status_code=e.status)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0, *, secret: str,
                 api_key: str | None = None, instance_api_key: str | None = None) -> None:
        """secret: the deployment's (disagg/trust.py); api_key: what clients must send the proxy;
        instance_api_key: what the proxy sends the instances (their --api-key)."""
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode instance URL")
        self.secret, self.api_key = secret, api_key
        self.headers = {"Authorization": f"Bearer {instance_api_key}"} if instance_api_key else {}
        self.prefill = [Upstream(u.rstrip("/")) for u in prefill]
        self.decode = [Upstream(u.rstrip("/")) for u in decode]
        # No cap on connections: each streamed answer holds one for its whole length, and httpx's default
        # cap (100) would make request 101 wait in the proxy, unseen by any instance, for --timeout seconds.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))
        self._releases: set[asyncio.Task] = set()  # in flight; referenced so they are not collected midway

    async def handle(self, path: str, raw: Request):
        """Route one request; a client that leaves meanwhile cancels it. A streamed answer notices the
        client's departure itself (Starlette); a JSON one would otherwise be computed to the end for nobody,
        because nothing else watches the client while the instances work. Cancelling closes the upstream
        connections, and each instance aborts the request (its own disconnect check) and frees its blocks."""
        data = await raw.body()  # read first: is_disconnected() would swallow body chunks still to come
        task = asyncio.ensure_future(self._handle(path, data))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    logger.info("client left before its answer was ready: cancelling %s", path)
                    task.cancel()
                    return Response(status_code=499)
        finally:
            if not task.done():
                task.cancel()

    async def _handle(self, path: str, data: bytes):
        body = parse_body(data)
        if isinstance(body, Response):
            return body
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object", 400)
        if body.get("kv_transfer_params") is not None:
            return _error("kv_transfer_params are set by the proxy; omit them", 400, param="kv_transfer_params")
        headers = self.headers  # the deployment's credentials, never the client's
        text = _prompt_text(body)
        size, hashes = len(text), prefix_hashes(text)
        unreachable, turned_away = [], None
        for pre in by_preference(self.prefill, hashes):
            pre.load += size
            try:
                answer = await self._post(pre, path, _prefill_body(body, self.secret), headers)
            finally:
                pre.load -= size
            if _turned_away(answer):  # its SLO admission predicts a missed TTFT target: try the next one
                turned_away = answer
                continue
            if answer is not None:
                if isinstance(answer, dict):  # it computed the prompt (an error answer computed nothing)
                    pre.remember(hashes)
                break
            unreachable.append(pre.url)  # it did no work (unreachable, engine dead): the next one may serve it
        else:
            return turned_away or _unreachable("prefill", unreachable)
        if not isinstance(answer, dict):
            return answer  # the prefill instance's error, relayed
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            return _error(f"the prefill instance {pre.url} answered without kv_transfer_params; start it with "
                          "--kv-transfer-config", 502, code="bad_gateway")
        usage = answer.get("usage")
        tokens = _count(usage.get("prompt_tokens") if isinstance(usage, dict) else None) + _count(
            body.get("max_completion_tokens") or body.get("max_tokens"))
        cached = _cached_tokens(usage)

        def refused():  # the decode instance answered an error: nobody will pull the KV
            self._release(pre, params, headers)

        unreachable = []
        for dec in by_preference(self.decode):
            answer = await self._relay(dec, path, {**body, "kv_transfer_params": params}, headers, tokens, cached,
                                       refused)
            if answer is not None:
                return answer
            unreachable.append(dec.url)  # the prefill's KV waits for whichever decode instance comes
        self._release(pre, params, headers)
        return _unreachable("decode", unreachable)

    def _release(self, pre: Upstream, params: dict, headers: dict) -> None:
        """Tell the prefill instance to free the KV it holds for this request, in the background: the
        client's error answer does not wait for it, and the client leaving does not cancel it."""
        task = asyncio.ensure_future(self._post_release(pre, params, headers))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _post_release(self, pre: Upstream, params: dict, headers: dict) -> None:
        try:
            r = await self.http.post(pre.url + "/kv_transfer/release", json={"kv_transfer_params": params},
                                     headers=headers, timeout=RELEASE_TIMEOUT_S)
        except httpx.HTTPError as e:
            logger.warning("could not release KV at %s (%s: %s); it is freed at its kv_hold_timeout", pre.url,
                           type(e).__name__, e)
            return
        if r.status_code != 200:
            logger.warning("the prefill instance %s refused to release KV (%d: %s); it is freed at its "
                           "kv_hold_timeout", pre.url, r.status_code, r.text[:200])

    async def _post(self, up: Upstream, path: str, body: dict, headers: dict):
        """The instance's JSON answer, the Response to send back when it failed, or None when it could not
        be connected to or its engine is dead (it did no work: another instance may take it)."""
        try:
            r = await self.http.post(up.url + path, json=body, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            up.down_until = time.monotonic() + DOWN_S
            return None
        except httpx.HTTPError as e:
            return _error(f"the prefill instance {up.url} failed: {type(e).__name__}: {e}", 503,
                          code="upstream_unavailable")
        up.down_until = 0.0
        if _engine_dead(r.status_code, r.content):
            up.healthy = False
            return None
        if r.status_code != 200:
            retry = {"Retry-After": r.headers["retry-after"]} if "retry-after" in r.headers else None
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"), headers=retry)
        try:
            return r.json()
        except ValueError:
            return _error(f"the prefill instance {up.url} answered with something other than JSON", 502,
                          code="bad_gateway")

    async def _relay(self, up: Upstream, path: str, body: dict, headers: dict, tokens: int, cached: int | None,
                     refused=lambda: None):
        """The decode instance's answer relayed (its usage says what the prefill's prefix cache served), or
        None when it could not be connected to. refused() is called when it answered an error status (it is
        done with the request: it pulls nothing more)."""
        up.load += tokens
        try:
            r = await self.http.send(self.http.build_request("POST", up.url + path, json=body, headers=headers),
                                     stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            up.load -= tokens
            up.down_until = time.monotonic() + DOWN_S
            return None
        except BaseException as e:  # a timeout, or the client left (cancelled): its tokens leave the load too
            up.load -= tokens
            if not isinstance(e, httpx.HTTPError):
                raise
            # No answer came (a timeout, say): the decode instance may still be pulling the KV, so it is
            # not released here (the decode instance frees it when its pull ends or fails).
            return _error(f"the decode instance {up.url} failed: {type(e).__name__}: {e}", 503,
                          code="upstream_unavailable")
        up.down_until = 0.0
        media = r.headers.get("content-type", "application/json")
        if r.status_code != 200 or not media.startswith("text/event-stream"):
            try:
                content = await r.aread()
            finally:
                await r.aclose()
                up.load -= tokens
            if _engine_dead(r.status_code, content):  # it did not take the request: another decode may
                up.healthy = False
                return None
            if r.status_code != 200:
                refused()
            if r.status_code == 200:
                content = _patch_usage(content, cached)
            return Response(content, r.status_code, media_type=media)

        async def stream():
            pending = b""
            try:
                async for chunk in r.aiter_raw():
                    # Whole events only, so the one carrying the usage can be patched; the rest pass as is.
                    events = (pending + chunk).split(b"\n\n")
                    pending = events.pop()
                    if events:
                        yield b"".join(_patch_event(e, cached) + b"\n\n" for e in events)
                if pending:
                    yield pending
            except httpx.HTTPError as e:
                # The decode instance died or timed out mid-answer: say so in the stream, as a server whose
                # engine fails does, instead of cutting the connection (the client saw only a broken read).
                logger.warning("the decode stream from %s broke: %s", up.url, e)
                err = APIError(f"the decode instance {up.url} broke off the answer: {type(e).__name__}: {e}",
                               503, code="upstream_unavailable").body()
                yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:  # done, or the client left: closing the stream aborts the request at the instance
                await r.aclose()
                up.load -= tokens

        return StreamingResponse(stream(), media_type=media)

    async def _healthy(self, up: Upstream) -> bool:
        try:
            return (await self.http.get(up.url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    async def check_health(self) -> list[bool]:
        """Ask every instance's /health now; their `healthy` follows."""
        pools = self.prefill + self.decode
        states = await asyncio.gather(*(self._healthy(u) for u in pools))
        for up, ok in zip(pools, states):
            if up.healthy != ok:
                logger.warning("instance %s is %s", up.url, "healthy again" if ok else "unhealthy: routing around it")
            up.healthy = ok
        return states

    async def watch_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def health(self) -> JSONResponse:
        states = await self.check_health()
        body = {"prefill": {u.url: s for u, s in zip(self.prefill, states)},
                "decode": {u.url: s for u, s in zip(self.decode, states[len(self.prefill):])}}
        return JSONResponse(body, status_code=200 if all(states) else 503)


def build_app(proxy: Proxy, max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.ensure_future(proxy.watch_health())
        yield
        watcher.cancel()
        await proxy.http.aclose()  # the pooled upstream connections close with the proxy

    app = FastAPI(title="moeserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    # the client's key (before a body nobody may send is read) and the body limit, for every route
    app.add_middleware(RequestGuard, router=app.router, api_key=proxy.api_key, max_body=max_request_body_size,
                       public={"/health"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):  # 404, 405 (with its Allow header): OpenAI bodies
        return JSONResponse(APIError(str(e.detail), e.status_code).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await proxy.handle("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await proxy.handle("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models():
        try:
            r = await proxy.http.get(proxy.decode[0].url + "/v1/models", headers=proxy.headers)
        except httpx.HTTPError as e:
            return _error(f"the decode instance {proxy.decode[0].url} is unreachable: {e}", 503)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        return await proxy.health()

    return app
