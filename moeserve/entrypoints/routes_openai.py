"""The OpenAI API of one API server: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, and
vLLM's /tokenize and /detokenize.

Bodies are read as bytes and parsed with the bounded parser (nesting depth, finite numbers) into the pydantic
request models, so a malformed body is a 400 in OpenAI's error shape; /openapi.json documents the models
(openapi_extra). The API key and the body limit are the app's (http_guard.RequestGuard); the routes that
need the engine depend on the server's engine-alive check.
"""
from __future__ import annotations

import functools
import time

from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError

from moeserve.entrypoints.errors import APIError, validation_error
from moeserve.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, parse_json)
from moeserve.entrypoints.serving_responses import ResponsesServing


def parse_body(model, body: bytes):
    """A request body as `model`, or the 400 naming what is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def json_object(body: bytes) -> dict:
    """A request body that must be a JSON object, read with the bounded parser of every route."""
    value = parse_json(body)
    if not isinstance(value, dict):
        raise APIError("the request body must be a JSON object")
    return value


def documented_body(model, defs: dict) -> dict:
    """openapi_extra documenting a request body the handler parses itself; the model's nested schemas go to
    the components (defs)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs.update(schema.pop("$defs", {}))
    defs[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_openai_routes(app: FastAPI, spec, tokenizer, completions, chat, engine_alive, defs: dict) -> None:
    """completions / chat: the server's CompletionServing and ChatServing; engine_alive: its dependency that
    answers 503 while the engine is gone; defs: the request-body schemas for /openapi.json."""
    needs_engine = [Depends(engine_alive)]
    responses = ResponsesServing(chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                            "owned_by": "moeserve", "root": spec.model_path,
                                            "max_model_len": spec.max_model_len}
                                           for n in spec.server.served_model_names]}

    @app.post("/v1/completions", dependencies=needs_engine,
                 openapi_extra=documented_body(CompletionRequest, defs))
    async def create_completion(raw: Request):
        return await completions.create(parse_body(CompletionRequest, await raw.body()), raw)

    @app.post("/v1/chat/completions", dependencies=needs_engine,
                 openapi_extra=documented_body(ChatCompletionRequest, defs))
    async def create_chat_completion(raw: Request):
        return await chat.create(parse_body(ChatCompletionRequest, await raw.body()), raw)

    @app.post("/v1/responses", dependencies=needs_engine)
    async def create_response(raw: Request):
        return await responses.create(json_object(await raw.body()), raw)

    # vLLM's token endpoints: what the server would feed the engine, without running it.
    @app.post("/tokenize", openapi_extra=documented_body(TokenizeRequest, defs))
    async def tokenize(raw: Request):
        req = parse_body(TokenizeRequest, await raw.body())
        chat.check_model(req.model)
        req.check()
        if req.messages is not None:
            size = chat.check_messages_size(req.messages)
            ids = await chat.off_loop(chat.render_messages, req.messages, req.add_generation_prompt, size=size)
        else:
            chat.check_text_size(len(req.prompt))
            ids = await chat.off_loop(functools.partial(tokenizer.encode, add_special_tokens=req.add_special_tokens),
                                      req.prompt, size=len(req.prompt))
        return {"count": len(ids), "max_model_len": spec.max_model_len, "tokens": ids}

    @app.post("/detokenize", openapi_extra=documented_body(DetokenizeRequest, defs))
    async def detokenize(raw: Request):
        req = parse_body(DetokenizeRequest, await raw.body())
        chat.check_model(req.model)
        try:
            chat.check_token_ids(req.tokens)
        except APIError as e:
            raise APIError(str(e).replace("prompt token id", "token id"), param="tokens") from None
        return {"prompt": await chat.off_loop(tokenizer.decode, req.tokens)}

