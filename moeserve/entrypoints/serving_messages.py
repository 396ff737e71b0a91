"""/v1/messages: Anthropic's Messages API (as vLLM serves it), on top of the chat handler.

system -> a system message; text / tool_use / tool_result blocks -> chat messages, tool calls and tool
results; tools (input_schema) -> function tools; tool_choice auto / any / tool / none -> auto / required /
a named function / none; stop_sequences -> stop. The chat answer becomes a message with text and tool_use
content blocks and Anthropic's stop_reason; streaming sends message_start, content_block_start /
_delta / _stop, message_delta and message_stop events.
"""
from __future__ import annotations

import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.entrypoints.chat_events import ChoiceDelta, Failed, Usage
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import ChatCompletionRequest, chat_request_from
from moeserve.entrypoints.serving import engine_error

SERVED = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "tools", "tool_choice", "metadata", "chat_template_kwargs", "thinking"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(b.get("text", "") for b in content)
    raise APIError(f"{where}: content must be a string or text blocks", param="messages")


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("system"):
        out.append({"role": "system", "content": _blocks_text(body["system"], "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", param="messages")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError("each message needs 'role' user or assistant", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise APIError("a message's content must be a string or a list of blocks", param="messages")
        text, calls = "", []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text += b.get("text", "")
            elif kind == "tool_use":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result":
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": result if isinstance(result, str) else _blocks_text(result, "tool_result")})
            else:
                raise APIError(f"content block type {kind!r} is not supported (text, tool_use, tool_result)",
                               param="messages")
        if text or calls:
            out.append({"role": m["role"], "content": text or None, **({"tool_calls": calls} if calls else {})})
    return out


def _tools(body: dict) -> dict:
    out: dict = {}
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                          "parameters": t.get("input_schema")}}
                        for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        if mapped is None:
            raise APIError("tool_choice type must be auto, any, tool or none", param="tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
        out["tool_choice"] = mapped
    return out


# /v1/messages/count_tokens (Anthropic's messages.count_tokens): what it reads of a body
COUNT_SERVED = {"model", "messages", "system", "tools", "tool_choice", "chat_template_kwargs", "thinking"}


def _thinking(body: dict) -> dict:
    """Anthropic's `thinking` as vLLM maps it: disabled -> reasoning_effort "none" (enable_thinking false for
    the chat template); enabled: budget_tokens (>= 1024) is the request's thinking_token_budget (needs
    --reasoning-parser, as in vLLM); adaptive pins nothing. The reasoning a --reasoning-parser splits off comes
    back as thinking blocks."""
    t = body.get("thinking")
    if t is None:
        return {}
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError("thinking.type must be enabled, disabled or adaptive", param="thinking")
    if kind == "disabled":
        return {"reasoning_effort": "none"}
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise APIError("thinking.budget_tokens must be an integer >= 1024", param="thinking.budget_tokens")
        return {"thinking_token_budget": budget}
    return {}


def to_chat_request(body: dict, count_only: bool = False) -> ChatCompletionRequest:
    """The chat request a /v1/messages body is served by (count_only: a count_tokens body, no max_tokens)."""
    where = "/v1/messages/count_tokens" if count_only else "/v1/messages"
    unknown = sorted(set(body) - (COUNT_SERVED if count_only else SERVED))
    if unknown:
        raise APIError(f"'{unknown[0]}' is not supported by {where}", param=unknown[0])
    if count_only:
        body = {**body, "max_tokens": 1}
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise APIError("'max_tokens' is required (an integer)", param="max_tokens")
    chat = {"model": body.get("model"), "messages": _messages(body), "max_tokens": body["max_tokens"],
            "stream": bool(body.get("stream")), **_tools(body), **_thinking(body)}
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    return chat_request_from(chat, body, ("temperature", "top_p", "top_k", "chat_template_kwargs"))


def _stop(choice: dict, tool_used: bool = False) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice. As vLLM: tool_use whenever a tool was called
    (a forced tool's chat finish_reason is "stop"), max_tokens when cut by the length."""
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    if isinstance(choice.get("stop_reason"), str):
        return "stop_sequence", choice["stop_reason"]
    return STOP_REASONS.get(finish, "end_turn"), None


class MessagesServing:
    def __init__(self, chat) -> None:
        self.chat = chat

    async def create(self, body: dict, raw: Request):
        req = to_chat_request(body)
        mid = f"msg_{uuid.uuid4().hex}"
        answer = await self.chat.create(req, raw, encode=lambda events: self._events(mid, events))
        if not req.stream:
            return JSONResponse(self._message(mid, json.loads(answer.body)))
        return answer  # the Messages events, or an error found before the first token

    async def count_tokens(self, body: dict) -> JSONResponse:
        """Anthropic's messages.count_tokens (as vLLM serves it): the prompt tokens the message would take,
        rendered with the chat template, tools included."""
        req = to_chat_request(body, count_only=True)
        self.chat.check_model(req.model)
        size = self.chat.check_messages_size(req.messages)
        ids = await self.chat.off_loop(self.chat.render, req, size=size)
        return JSONResponse({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})

    def _message(self, mid: str, chat: dict) -> dict:
        choice = chat["choices"][0]
        msg = choice["message"]
        content = [{"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""}] \
            if msg.get("reasoning_content") else []
        content += [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"] or "{}")} for c in msg.get("tool_calls") or []]
        reason, seq = _stop(choice, any(b["type"] == "tool_use" for b in content))
        u = chat["usage"]
        return {"id": mid, "type": "message", "role": "assistant", "model": self.chat.model_name, "content": content,
                "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}}

    async def _events(self, mid: str, events):
        """Typed chat events (chat_events.py) -> Anthropic Messages events."""
        def event(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

        yield event("message_start", message={"id": mid, "type": "message", "role": "assistant", "content": [],
                                              "model": self.chat.model_name, "stop_reason": None,
                                              "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
        index, open_kind, reason, seq, usage = -1, None, "end_turn", None, {"output_tokens": 0}
        tool_used = False
        async for e in events:
            if isinstance(e, Failed):
                error = engine_error(e.error).body()["error"]
                yield event("error", error={"type": "api_error", "message": error.get("message", "")})
                return
            if isinstance(e, Usage):
                usage = {"input_tokens": e.usage["prompt_tokens"], "output_tokens": e.usage["completion_tokens"]}
            if not isinstance(e, ChoiceDelta):
                continue
            if e.reasoning:
                if open_kind != "thinking":
                    if open_kind is not None:
                        yield event("content_block_stop", index=index)
                    index, open_kind = index + 1, "thinking"
                    yield event("content_block_start", index=index,
                                content_block={"type": "thinking", "thinking": "", "signature": ""})
                yield event("content_block_delta", index=index,
                            delta={"type": "thinking_delta", "thinking": e.reasoning})
            if e.content:
                if open_kind != "text":
                    if open_kind is not None:
                        yield event("content_block_stop", index=index)
                    index, open_kind = index + 1, "text"
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": e.content})
            for call in e.tool_calls or []:
                tool_used = True
                if open_kind is not None:
                    yield event("content_block_stop", index=index)
                    open_kind = None
                index += 1
                yield event("content_block_start", index=index, content_block={
                    "type": "tool_use", "id": call.get("id"), "name": call["function"]["name"], "input": {}})
                yield event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]})
                yield event("content_block_stop", index=index)
            if e.finish_reason:
                reason, seq = _stop({"finish_reason": e.finish_reason, "stop_reason": e.stop_reason}, tool_used)
        if open_kind is not None:
            yield event("content_block_stop", index=index)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=usage)
        yield event("message_stop")
