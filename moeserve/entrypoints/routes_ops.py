"""What operators and load balancers ask one API server: /health, /ping (SageMaker's, GET or POST), /load
(requests in flight here), /version, /metrics, /server_info (what this deployment runs), /reset_prefix_cache
(a benchmark's cold start), PD's /kv_transfer/release (docs/from-vllm.md; /docs and /openapi.json are FastAPI's own, off with
--disable-fastapi-docs).
The probes need no API key (http_guard.PROBES); the rest are guarded like every route."""
from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import parse_json
from moeserve.version import __version__


def add_ops_routes(app: FastAPI, spec, client, engine_alive) -> None:
    cfg = spec.server
    needs_engine = [Depends(engine_alive)]

    @app.get("/health", dependencies=needs_engine)
    async def health():
        """200 while the engine serves; 503 while it is gone (restarting) or hung (--engine-stall-timeout)."""
        stalled = client.stall_reason()
        if stalled:
            raise APIError(f"the engine is not making progress: {stalled}", 503, code="engine_stalled")
        return Response(status_code=200)

    # one route per method: one route with both gave FastAPI's "Duplicate Operation ID" warning on /openapi.json
    @app.get("/ping", operation_id="ping_get", dependencies=needs_engine)
    @app.post("/ping", operation_id="ping_post", dependencies=needs_engine)
    async def ping():
        return Response(status_code=200)

    @app.get("/load")
    async def load():
        return {"server_load": len(client.streams)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_endpoint():
        from prometheus_client import CONTENT_TYPE_LATEST

        from moeserve.entrypoints.metrics import render
        return Response(render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info():
        ready = client.ready
        return {"version": __version__, "served_model_names": list(cfg.served_model_names),
                "model": spec.model_path, "max_model_len": spec.max_model_len, "kv_role": spec.kv_role,
                "num_kv_blocks": ready.num_kv_blocks if ready else None,
                "cache_config": spec.cache_info or {}, "api_server_index": spec.index,
                "engine": {"num_running": client.stats.num_running, "num_waiting": client.stats.num_waiting,
                           "kv_cache_usage": client.stats.kv_cache_usage}}

    @app.post("/reset_prefix_cache", dependencies=needs_engine)
    async def reset_prefix_cache():
        await client.call_utility("reset_prefix_cache")
        return Response(status_code=200)

    @app.post("/kv_transfer/release", dependencies=needs_engine, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": {"type": "object"}}}}})
    async def release_kv(raw: Request):
        """PD: free the KV a prefill answer said it holds, because no decode instance will pull it (the proxy
        calls this when the decode instance refused the request or was unreachable). An abort of the
        prefill's request id: the engine frees held blocks and ignores ids it holds nothing for. Only a
        signed prefill answer of this deployment names what to free (disagg/trust.py)."""
        from moeserve.disagg.params import KVTransferParamsError, held_request_id
        if spec.kv_role not in ("kv_producer", "kv_both"):
            raise APIError("this server holds no KV for decode instances: start it with --kv-transfer-config "
                           "'{\"kv_connector\": \"nixl\", \"kv_role\": \"kv_producer\"}'", param="kv_transfer_params")
        try:
            rid = held_request_id(parse_json(await raw.body()), spec.kv_secret)
        except KVTransferParamsError as e:
            raise APIError(str(e), param="kv_transfer_params") from None
        client.abort_nowait([rid])
        return {"released": rid}

