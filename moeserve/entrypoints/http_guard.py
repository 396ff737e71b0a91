"""The checks every request to a moeserve HTTP app passes, at the ASGI layer, so no route can skip them.

The API server and the PD proxy wrap their whole app in RequestGuard (a route does nothing to opt in):
- the API key: any route of the app outside `public` (the probes) needs `Authorization: Bearer KEY` or
  Anthropic's `x-api-key: KEY`, compared in constant time; checked first, before any byte of the body is
  read. A path no route takes stays a 404 (nothing there to protect);
- the body limit: a body known to exceed it (its Content-Length, else counted while it streams in) is a 413
  before the app sees any of it. The app then reads the buffered body as usual.
Both answer OpenAI's error shape.
"""
from __future__ import annotations

import hmac

from starlette._utils import get_route_path
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import Match, Router

from moeserve.entrypoints.errors import APIError

# Probes and docs: load balancers, Prometheus and SageMaker (/ping, GET or POST) ask them without a key.
PROBES = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/docs", "/openapi.json"})


def unauthorized() -> APIError:
    return APIError("missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", 401,
                    code="invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-body-size); send less", 413, code="request_too_large")


def key_matches(headers: Headers, api_key: str) -> bool:
    """Either header carries the key. Constant time: how long a comparison takes says nothing about how much
    of the key matched (both are compared, so neither header's presence shows in the timing either)."""
    bearer = hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {api_key}".encode())
    anthropic = hmac.compare_digest(headers.get("x-api-key", "").encode(), api_key.encode())
    return bearer | anthropic


class RequestGuard:
    """ASGI middleware: the API key (unless api_key is None) and the body limit, for every HTTP request.
    router: the app's (its routes, also those added after this middleware); on_error(status) is told of
    each refusal (the server's error metrics)."""

    def __init__(self, app, *, router: Router, api_key: str | None, max_body: int, public=PROBES,
                 on_error=None) -> None:
        self.app, self.router, self.api_key, self.max_body = app, router, api_key, max_body
        self.public, self.on_error = frozenset(public), on_error

    def needs_key(self, scope) -> bool:
        if self.api_key is None or get_route_path(scope) in self.public:
            return False
        # a route of the app, whatever the method (a wrong one is a 405: only for a client with the key)
        return any(route.matches(scope)[0] != Match.NONE for route in self.router.routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.needs_key(scope) and not key_matches(headers, self.api_key):
            return await self._refuse(unauthorized(), scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            return await self._refuse(too_large(self.max_body), scope, receive, send)
        first = await self._read_body(receive)
        if first is None:
            return await self._refuse(too_large(self.max_body), scope, receive, send)

        async def replay():  # the buffered body once, then the connection's own messages (a disconnect)
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> dict | None:
        """The whole body as one http.request message (or the disconnect that cut it short); None as soon
        as it exceeds the limit, without reading the rest."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # the client left: the app sees it as it would have
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, err: APIError, scope, receive, send) -> None:
        if self.on_error is not None:
            self.on_error(err.status)
        await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
