"""Anthropic's Messages API of one API server, as vLLM serves it: /v1/messages (serving_messages.py, on the
chat handler) and /v1/messages/count_tokens. Errors on these paths take Anthropic's shape (api_server's
error handler). The API key (Bearer or x-api-key) and the body limit are the app's (http_guard)."""
from __future__ import annotations

from fastapi import Depends, FastAPI, Request

from moeserve.entrypoints.routes_openai import json_object
from moeserve.entrypoints.serving_messages import MessagesServing

PREFIX = "/v1/messages"


def add_anthropic_routes(app: FastAPI, chat, engine_alive) -> None:
    messages = MessagesServing(chat)

    @app.post(PREFIX, dependencies=[Depends(engine_alive)])
    async def create_message(raw: Request):
        return await messages.create(json_object(await raw.body()), raw)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(raw: Request):
        """The prompt tokens of a /v1/messages body (no engine work)."""
        return await messages.count_tokens(json_object(await raw.body()))

