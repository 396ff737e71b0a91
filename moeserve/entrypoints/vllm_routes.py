"""The endpoints vLLM's server has beside the OpenAI ones, and its CORS options (docs/from-vllm.md).

/v1/responses (OpenAI's Responses API, serving_responses.py), /v1/messages (Anthropic's Messages API,
serving_messages.py), /ping (SageMaker's health check: GET or POST, as /health), /load (requests in flight in this API server),
/server_info (what this deployment runs), /reset_prefix_cache (the engine forgets its cached prefixes; a
benchmark's cold start), /docs (Swagger UI over /openapi.json). CORS headers only when --allowed-origins
names origins (vLLM sends `*` by default; moeserve sends none unless asked). The API key and the body limit
are the app's (http_guard.RequestGuard), as for every route.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from moeserve.entrypoints.openai_protocol import APIError, parse_json


def _json_body(text: bytes) -> dict:
    body = parse_json(text)  # the bounded parser of every route (nesting, finite numbers)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def add_vllm_routes(app: FastAPI, spec, client, chat, check_engine) -> None:
    """chat: the server's ChatServing, which /v1/responses and /v1/messages run on (None: not served);
    check_engine: the server's engine-alive check (raises its 503)."""
    cfg = spec.server
    if cfg.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)

    # one route per method: one route with both gave FastAPI's "Duplicate Operation ID" warning on /openapi.json
    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")
    async def ping():
        check_engine()
        return Response(status_code=200)

    @app.get("/load")
    async def load():
        return {"server_load": len(client.streams)}

    @app.get("/server_info")
    async def server_info():
        from moeserve.version import __version__
        ready = client.ready
        return {"version": __version__, "served_model_names": list(cfg.served_model_names),
                "model": spec.model_path, "max_model_len": spec.max_model_len, "kv_role": spec.kv_role,
                "num_kv_blocks": ready.num_kv_blocks if ready else None,
                "cache_config": spec.cache_info or {}, "api_server_index": spec.index,
                "engine": {"num_running": client.stats.num_running, "num_waiting": client.stats.num_waiting,
                           "kv_cache_usage": client.stats.kv_cache_usage}}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        check_engine()
        await client.call_utility("reset_prefix_cache")
        return Response(status_code=200)

    if chat is not None:
        from moeserve.entrypoints.serving_responses import ResponsesServing
        responses_serving = ResponsesServing(chat)

        @app.post("/v1/responses")
        async def responses(raw: Request):
            check_engine()
            return await responses_serving.create(_json_body(await raw.body()), raw)

        from moeserve.entrypoints.serving_messages import MessagesServing
        messages_serving = MessagesServing(chat)

        @app.post("/v1/messages")
        async def messages(raw: Request):
            check_engine()
            return await messages_serving.create(_json_body(await raw.body()), raw)

        @app.post("/v1/messages/count_tokens")
        async def messages_count_tokens(raw: Request):
            """Anthropic's messages.count_tokens: the prompt tokens of a /v1/messages body (no engine work)."""
            return await messages_serving.count_tokens(_json_body(await raw.body()))

    if cfg.disable_fastapi_docs:  # vLLM's --disable-fastapi-docs: neither page is served
        return

    @app.get("/docs", include_in_schema=False)
    async def docs():
        from fastapi.openapi.docs import get_swagger_ui_html
        return get_swagger_ui_html(openapi_url=(cfg.root_path or "") + "/openapi.json",
                                   title="moeserve - Swagger UI")

    if not any(getattr(r, "path", None) == "/openapi.json" for r in app.routes):
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi():
            return JSONResponse(app.openapi())
