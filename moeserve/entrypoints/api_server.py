"""One API-server process: the FastAPI app (one module of routes per API: routes_openai.py, routes_anthropic.py,
routes_ops.py; one guard, one engine-alive dependency, one set of error handlers), talking to the engine
core over ZMQ.

Several of these run side by side (--api-server-count), all accepting on the one listening socket the
launcher bound (the kernel hands each connection to one of them), each with its own tokenizer and
detokenizer and its own connection to the engine core.

Request bounds, before any work: the API key and --max-request-body-size hold for every route, checked at
the ASGI layer (http_guard.RequestGuard: a 401, a 413 before the app sees the body); prompt text that
cannot fit --max-model-len is a 400 before it is tokenized (serving.Serving.check_text_size); big inputs
tokenize on their own thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.config import ServerConfig
from moeserve.entrypoints.engine_client import EngineClient
from moeserve.entrypoints.http_guard import RequestGuard
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.routes_anthropic import PREFIX as ANTHROPIC_PREFIX
from moeserve.entrypoints.routes_anthropic import add_anthropic_routes
from moeserve.entrypoints.routes_openai import add_openai_routes
from moeserve.entrypoints.routes_ops import add_ops_routes
from moeserve.entrypoints.serving import ClientDisconnected, end_grace_period
from moeserve.entrypoints.serving_chat import ChatServing
from moeserve.entrypoints.serving_completion import CompletionServing

logger = logging.getLogger("moeserve.api")


@dataclass
class ApiServerSpec:
    """Everything one API-server process needs (plain data: it crosses a process spawn)."""

    index: int
    server: ServerConfig
    engine_address: str
    model_path: str
    tokenizer_path: str
    eos_token_ids: list[int]
    max_model_len: int
    kv_role: str | None = None  # --kv-transfer-config kv_role (PD), None without it
    kv_secret: str | None = None  # PD: the deployment secret that signed prefill answers (disagg/trust.py)
    default_sampling: dict | None = None  # --generation-config: defaults for fields a request leaves unset
    sock: socket.socket | None = None  # the launcher's listening socket (passed as a file descriptor)
    cache_info: dict | None = None  # the cache configuration under vLLM's names (vllm:cache_config_info)
    logprobs_mode: str = "raw_logprobs"  # --logprobs-mode: set on every request this server sends


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket of this process alone: no SO_REUSEPORT, so a port in use is an error
    (EADDRINUSE) instead of a second server silently taking half the connections. SO_REUSEADDR only lets
    a restarted server bind while old connections linger in TIME_WAIT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


# vLLM's http_* metrics come from prometheus-fastapi-instrumentator on every route but these
HTTP_METRICS_EXCLUDED = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]


def _http_metrics(app: FastAPI, index: int) -> bool:
    """vLLM's http_requests_total, http_request_duration_seconds, http_request_size_bytes, ... (handler, method,
    status labels) from the maintained instrumentator vLLM uses; its values go to the multiprocess directory
    with the rest, so /metrics of any API server sums them. Installed with `pip install moeserve[metrics]`."""
    try:
        from prometheus_fastapi_instrumentator import Instrumentator
    except ImportError:
        if index == 0:
            logging.getLogger("moeserve").info("no http_* metrics: prometheus-fastapi-instrumentator is not "
                                               "installed (pip install 'moeserve[metrics]')")
        return False
    Instrumentator(excluded_handlers=HTTP_METRICS_EXCLUDED).add().instrument(app)
    return True


class RequestIdHeader:
    """--enable-request-id-headers (vLLM's): every answer carries X-Request-Id, the request's own when it sent
    one, else a fresh uuid4 hex."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers, MutableHeaders
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(spec: ApiServerSpec, tokenizer, client: EngineClient, metrics, on_ready=None) -> FastAPI:
    cfg = spec.server
    name = cfg.served_model_name
    completions = CompletionServing(client, tokenizer, name, spec.max_model_len, cfg.max_waiting_requests,
                                    spec.default_sampling)
    chat = ChatServing(client, tokenizer, name, spec.max_model_len, cfg.max_waiting_requests, spec.default_sampling,
                       chat_template=cfg.chat_template,
                       auto_tools=cfg.enable_auto_tool_choice and cfg.tool_call_parser is not None,
                       reasoning_parser=cfg.reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await client.start()
        if on_ready is not None:
            on_ready()
        yield
        await client.close()

    from moeserve.version import __version__
    docs = not cfg.disable_fastapi_docs  # --disable-fastapi-docs: no /docs, no /openapi.json (vLLM's)
    app = FastAPI(title="moeserve", version=__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    _add_error_handlers(app, metrics)
    _add_schemas(app)
    # Added before the CORS middleware, so CORS wraps it (a browser can read a 401 or 413).
    app.add_middleware(RequestGuard, router=app.router, api_key=cfg.api_key,
                       max_body=cfg.max_request_body_size, on_error=metrics.http_error if metrics else None)
    _http_metrics(app, spec.index)
    if cfg.enable_request_id_headers:  # outside the guard: its 401 / 413 answers carry the id too
        app.add_middleware(RequestIdHeader)
    for serving in (completions, chat):
        serving.force_usage = cfg.enable_force_include_usage
        serving.tokens_as_ids = cfg.return_tokens_as_token_ids
        serving.prompt_details = cfg.enable_prompt_tokens_details
    chat.response_role = cfg.response_role
    completions.model_aliases = chat.model_aliases = cfg.served_model_aliases

    def engine_alive() -> None:  # the dependency of every route that needs the engine
        if not client.healthy:
            raise APIError(f"the engine is not available ({client.dead_reason})", 503, code="engine_dead")

    if cfg.allowed_origins:  # CORS headers only when --allowed-origins names origins (vLLM sends `*` by default)
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)
    # One module per API, each adding its routes to this app (not include_router: FastAPI 0.165 nests an
    # included router as one route, and the guard and its test enumerate the app's own routes).
    add_openai_routes(app, spec, tokenizer, completions, chat, engine_alive, app.state.body_schemas)
    add_anthropic_routes(app, chat, engine_alive)
    add_ops_routes(app, spec, client, engine_alive)
    return app


def _add_schemas(app: FastAPI) -> None:
    """/openapi.json with the request bodies' schemas (collected by routes_openai.documented_body) among its components."""
    app.state.body_schemas = {}
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(app.state.body_schemas)
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI, metrics) -> None:
    def answer(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        if metrics is not None:
            metrics.http_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        if request.url.path.startswith(ANTHROPIC_PREFIX):  # Anthropic's shape, as vLLM serves it there
            body = {"type": "error", "error": {"type": e.body()["error"]["type"], "message": e.message}}
            return answer(e.status, body, e.headers)
        return answer(e.status, e.body(), e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        # the headers carry e.g. a 405's Allow (the methods the path takes)
        return answer(e.status_code, APIError(str(e.detail), e.status_code).body(), e.headers)

    @app.exception_handler(ClientDisconnected)
    async def gone(request, e):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        logger.exception("internal error serving %s", request.url.path)
        return answer(500, APIError(f"internal server error: {type(e).__name__}: {e}", 500).body())


async def _watch_parent(server) -> None:
    """Exit when the launcher is gone, so no API server outlives its deployment."""
    parent = os.getppid()
    while not server.should_exit:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            logger.error("the launcher process died; API server exits")
            server.should_exit = True


GRACE_BACKSTOP_S = 3.0  # after --shutdown-timeout: for the error events to be written before uvicorn cancels


def _draining_server(config, grace_s: float):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's graceful shutdown, except that the requests still running when --shutdown-timeout ends
        are answered (serving.end_grace_period: an error event and [DONE], or a 503) instead of cut."""

        def __init__(self, config, grace_s: float) -> None:
            super().__init__(config)
            self.grace_s = grace_s

        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, end_grace_period)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn raises the signal it caught again once it is done: the default SIGTERM action would
            # kill this process (exit code -15, no atexit, no finalizers) after a clean drain. Exit normally.
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return DrainingServer(config, grace_s)


def run_api_server(spec: ApiServerSpec, ready_event=None) -> None:
    """Process entry point (spawned by the launcher)."""
    import uvicorn

    from moeserve.entrypoints.metrics import ServerMetrics
    from moeserve.tokenizer import load_tokenizer

    cfg = spec.server
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [api server {spec.index}] %(message)s")
    tokenizer = load_tokenizer(spec.tokenizer_path)
    metrics = ServerMetrics(cfg.served_model_name, spec.index, spec.max_model_len, spec.cache_info)
    client = EngineClient(spec.engine_address, tokenizer, spec.eos_token_ids, spec.index, metrics,
                          stall_timeout=cfg.engine_stall_timeout)
    sock = spec.sock if spec.sock is not None else listen_socket(cfg.host, cfg.port)
    sock.setblocking(False)
    client.log_requests = cfg.enable_log_requests
    client.max_log_len = cfg.max_log_len
    client.logprobs_mode = spec.logprobs_mode
    app = build_app(spec, tokenizer, client, metrics, on_ready=ready_event.set if ready_event else None)
    # SIGTERM: uvicorn stops accepting and waits for the requests in flight (streams too); after
    # --shutdown-timeout those still running end with an error naming the shutdown (_draining_server); uvicorn
    # cancels only what is left GRACE_BACKSTOP_S later (a client that reads nothing)
    access_log = cfg.uvicorn_log_level in ("info", "debug", "trace") and not cfg.disable_uvicorn_access_log
    config = uvicorn.Config(app, log_level=cfg.uvicorn_log_level, access_log=access_log,
                            timeout_graceful_shutdown=cfg.shutdown_timeout + GRACE_BACKSTOP_S,
                            timeout_keep_alive=30,
                            lifespan="on", root_path=cfg.root_path or "", ssl_keyfile=cfg.ssl_keyfile,
                            ssl_certfile=cfg.ssl_certfile, ssl_ca_certs=cfg.ssl_ca_certs, ssl_cert_reqs=cfg.ssl_cert_reqs)
    server = _draining_server(config, cfg.shutdown_timeout)

    async def main():
        watcher = asyncio.create_task(_watch_parent(server))
        await server.serve(sockets=[sock])
        watcher.cancel()

    asyncio.run(main())
