"""`moeserve proxy`: one OpenAI endpoint in front of prefill and decode instances (system-brief item 1).

Lifecycle of a request: pick the prefill instance with the shortest estimated TTFT (the fewest prompt
characters in flight there: its queue) -> send it the request with max_tokens 1, stream false and
kv_transfer_params {"do_remote_decode": true} -> its answer says where the prompt's KV waits -> send the
original request with that kv_transfer_params to the decode instance with the least active tokens (prompt
+ max_tokens of the requests in flight there) -> relay the decode answer (JSON or SSE) unchanged. The
decode instance pulls the KV itself over NIXL; the proxy moves only JSON.

An instance's error reaches the client with its status and OpenAI body; an unreachable instance is a 503
naming it; a client that goes away closes the decode stream, which aborts the request there.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.entrypoints.openai_protocol import APIError

logger = logging.getLogger("moeserve.proxy")


@dataclass
class Upstream:
    url: str
    load: int = 0  # prefill: prompt characters in flight; decode: active tokens in flight


def least_loaded(pool: list[Upstream]) -> Upstream:
    return min(pool, key=lambda u: u.load)  # ties: the first listed


def _prefill_body(body: dict) -> dict:
    """The prefill instance's copy: one token, no streaming, KV kept for a decode instance."""
    pre = copy.deepcopy(body)
    for key in ("stream_options", "max_completion_tokens"):
        pre.pop(key, None)
    pre.update(max_tokens=1, min_tokens=0, stream=False, kv_transfer_params={"do_remote_decode": True})
    return pre


def _count(value) -> int:
    """A token count from JSON for load accounting; anything else counts 0 (the instance judges it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _prompt_size(body: dict) -> int:
    return len(json.dumps(body.get("prompt", body.get("messages", "")), ensure_ascii=False))


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(message, status, param, code).body(), status_code=status)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode instance URL")
        self.prefill = [Upstream(u.rstrip("/")) for u in prefill]
        self.decode = [Upstream(u.rstrip("/")) for u in decode]
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    async def handle(self, path: str, raw: Request):
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(f"the request body is not valid JSON: {e}", 400, code="invalid_json")
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object", 400)
        if body.get("kv_transfer_params") is not None:
            return _error("kv_transfer_params are set by the proxy; omit them", 400, param="kv_transfer_params")
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        pre = least_loaded(self.prefill)
        size = _prompt_size(body)
        pre.load += size
        try:
            answer = await self._post(pre, path, _prefill_body(body), headers)
        finally:
            pre.load -= size
        if not isinstance(answer, dict):
            return answer  # the prefill instance's error, relayed
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            return _error(f"the prefill instance {pre.url} answered without kv_transfer_params; start it with "
                          "--kv-transfer-config", 502, code="bad_gateway")
        dec = least_loaded(self.decode)
        tokens = _count(answer.get("usage", {}).get("prompt_tokens")) + _count(
            body.get("max_completion_tokens") or body.get("max_tokens"))
        return await self._relay(dec, path, {**body, "kv_transfer_params": params}, headers, tokens)

    async def _post(self, up: Upstream, path: str, body: dict, headers: dict):
        """The instance's JSON answer, or the Response to send back when it failed."""
        try:
            r = await self.http.post(up.url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            return _error(f"the prefill instance {up.url} is unreachable: {e}", 503, code="upstream_unavailable")
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        try:
            return r.json()
        except ValueError:
            return _error(f"the prefill instance {up.url} answered with something other than JSON", 502,
                          code="bad_gateway")

    async def _relay(self, up: Upstream, path: str, body: dict, headers: dict, tokens: int):
        up.load += tokens
        try:
            r = await self.http.send(self.http.build_request("POST", up.url + path, json=body, headers=headers),
                                     stream=True)
        except httpx.HTTPError as e:
            up.load -= tokens
            return _error(f"the decode instance {up.url} is unreachable: {e}", 503, code="upstream_unavailable")
        media = r.headers.get("content-type", "application/json")
        if r.status_code != 200 or not media.startswith("text/event-stream"):
            try:
                content = await r.aread()
            finally:
                await r.aclose()
                up.load -= tokens
            return Response(content, r.status_code, media_type=media)

        async def stream():
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:  # done, or the client left: closing the stream aborts the request at the instance
                await r.aclose()
                up.load -= tokens

        return StreamingResponse(stream(), media_type=media)

    async def health(self) -> JSONResponse:
        async def ok(up: Upstream) -> bool:
            try:
                return (await self.http.get(up.url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False
        pools = self.prefill + self.decode
        states = await asyncio.gather(*(ok(u) for u in pools))
        body = {"prefill": {u.url: s for u, s in zip(self.prefill, states)},
                "decode": {u.url: s for u, s in zip(self.decode, states[len(self.prefill):])}}
        return JSONResponse(body, status_code=200 if all(states) else 503)


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="moeserve proxy")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await proxy.handle("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await proxy.handle("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request):
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            r = await proxy.http.get(proxy.decode[0].url + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            return _error(f"the decode instance {proxy.decode[0].url} is unreachable: {e}", 503)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        return await proxy.health()

    return app
