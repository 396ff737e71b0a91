"""/v1/responses: OpenAI's Responses API (as vLLM serves it), on top of the chat handler.

A request becomes a ChatCompletionRequest (instructions -> a system message, input items -> messages,
function tools -> chat tools, text.format -> response_format, max_output_tokens -> max_tokens), runs
through ChatServing (templates, tool parsing, reasoning, structured output are the same code), and the
chat answer becomes a Response object: reasoning, message and function_call output items. Streaming
writes the chat handler's typed events (chat_events.py) as the Responses events (response.created, response.output_item.added,
response.output_text.delta, response.function_call_arguments.done, response.completed, ...) as they come.
Stored responses (store, previous_response_id, background) are not kept: those are refused with a 400.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.entrypoints.chat_events import ChoiceDelta, Failed, Usage
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import ChatCompletionRequest, chat_request_from
from moeserve.entrypoints.serving import engine_error

SERVED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "stream", "text", "metadata", "user", "store", "truncation", "include",
          "reasoning", "previous_response_id", "background", "top_k", "min_p", "seed", "stop",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "chat_template_kwargs", "service_tier",
          "prompt_cache_key"}


def _ids(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") or \
                    not isinstance(p.get("text"), str):
                raise APIError("input content parts must be {\"type\": \"input_text\", \"text\": ...} (text only)",
                               param="input")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError("a message's content must be a string or a list of input_text parts", param="input")


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("'input' must be a string or a non-empty list of items", param="input")
    for item in items:
        if not isinstance(item, dict):
            raise APIError("each 'input' item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back (DeepSeek templates drop it too)
        else:
            raise APIError(f"input item type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", param="input")
    return msgs


def _tools(body: dict) -> dict:
    out: dict = {}
    tools = body.get("tools")
    if tools:
        chat_tools = []
        for t in tools:
            if not isinstance(t, dict) or t.get("type") != "function":
                raise APIError(f"tool type {t.get('type') if isinstance(t, dict) else t!r} is not supported: "
                               "only function tools", param="tools")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if not fmt or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt.get("schema")}}}
    raise APIError(f"text.format type {fmt.get('type')!r} is not supported", param="text")


def to_chat_request(body: dict) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = sorted(set(body) - SERVED)
    if unknown:
        raise APIError(f"'{unknown[0]}' is not supported by /v1/responses", param=unknown[0])
    for field, ok in (("store", lambda v: v is False), ("previous_response_id", lambda v: False),
                      ("background", lambda v: v is False), ("include", lambda v: v == []),
                      ("truncation", lambda v: v == "disabled"), ("reasoning", lambda v: not v)):
        if body.get(field) is not None and not ok(body[field]):
            raise APIError(f"'{field}' is not supported: this server keeps no responses (send store false, "
                           "the whole conversation in input, no background/include/truncation/reasoning)",
                           param=field)
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": bool(body.get("stream")),
            **_tools(body), **_format(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat_request_from(chat, body, (
        "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p", "seed", "stop",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "chat_template_kwargs"))


class ResponsesServing:
    def __init__(self, chat) -> None:
        self.chat = chat

    async def create(self, body: dict, raw: Request):
        req = to_chat_request(body)
        if req.n != 1:
            raise APIError("/v1/responses answers one output", param="n")
        rid, created = _ids("resp"), int(time.time())
        answer = await self.chat.create(req, raw, encode=lambda events: self._events(body, rid, created, events))
        if not req.stream:
            return JSONResponse(self._response(body, rid, created, json.loads(answer.body)))
        return answer  # the Responses events, or an error found before the first token

    def _base(self, body: dict, rid: str, created: int, status: str) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "model": self.chat.model_name, "output": [],
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "top_p": body.get("top_p"), "truncation": "disabled", "usage": None, "user": body.get("user"),
                "metadata": body.get("metadata") or {}}

    @staticmethod
    def _usage(u: dict | None) -> dict | None:
        if u is None:
            return None
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0}}

    @staticmethod
    def _finish(resp: dict, finish: str | None) -> None:
        if finish == "length":
            resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}

    @staticmethod
    def _reasoning_item(text: str) -> dict:
        return {"type": "reasoning", "id": _ids("rs"), "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": _ids("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict) -> dict:
        return {"type": "function_call", "id": _ids("fc"), "call_id": call.get("id") or _ids("call"),
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def _response(self, body: dict, rid: str, created: int, chat: dict) -> dict:
        resp = self._base(body, rid, created, "completed")
        choice = chat["choices"][0]
        msg = choice["message"]
        if msg.get("reasoning_content"):
            resp["output"].append(self._reasoning_item(msg["reasoning_content"]))
        if msg.get("content"):
            resp["output"].append(self._message_item(msg["content"]))
        resp["output"] += [self._call_item(c) for c in msg.get("tool_calls") or []]
        self._finish(resp, choice["finish_reason"])
        resp["usage"] = self._usage(chat.get("usage"))
        return resp

    async def _events(self, body: dict, rid: str, created: int, events):
        """Typed chat events (chat_events.py) -> Responses events."""
        seq = iter(range(1 << 62))
        resp = self._base(body, rid, created, "in_progress")

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        yield event("response.created", response=dict(resp))
        yield event("response.in_progress", response=dict(resp))
        open_items: dict[str, tuple[int, dict]] = {}  # "reasoning" / "message" -> (output_index, item)
        finish = None

        def close(kind: str):
            idx, item = open_items.pop(kind)
            part = item["content"][0]
            if kind == "message":
                yield event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=part["text"], logprobs=[])
            else:
                yield event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=part["text"])
            yield event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                        part=part)
            item["status"] = "completed"
            yield event("response.output_item.done", output_index=idx, item=item)

        async for e in events:
            if isinstance(e, Failed):
                error = engine_error(e.error).body()["error"]
                code = "server_shutdown" if error.get("code") == "server_shutdown" else "server_error"
                resp["status"], resp["error"] = "failed", {"code": code, "message": error.get("message", "")}
                yield event("response.failed", response=resp)
                return
            if isinstance(e, Usage):
                resp["usage"] = self._usage(e.usage)
            if not isinstance(e, ChoiceDelta):
                continue
            for kind, text in (("reasoning", e.reasoning), ("message", e.content)):
                if not text:
                    continue
                if kind == "message" and "reasoning" in open_items:
                    for done in close("reasoning"):
                        yield done
                if kind not in open_items:
                    item = self._message_item("", "in_progress") if kind == "message" else \
                        {**self._reasoning_item(""), "status": "in_progress"}
                    open_items[kind] = (len(resp["output"]), item)
                    resp["output"].append(item)
                    yield event("response.output_item.added", output_index=open_items[kind][0],
                                item={**item, "content": []})
                    yield event("response.content_part.added", item_id=item["id"],
                                output_index=open_items[kind][0], content_index=0, part=dict(item["content"][0]))
                idx, item = open_items[kind]
                item["content"][0]["text"] += text
                name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
                extra = {"logprobs": []} if kind == "message" else {}
                yield event(name, item_id=item["id"], output_index=idx, content_index=0, delta=text, **extra)
            for call in e.tool_calls or []:
                for kind in list(open_items):
                    for done in close(kind):
                        yield done
                item = self._call_item(call)
                idx = len(resp["output"])
                resp["output"].append(item)
                yield event("response.output_item.added", output_index=idx,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                            arguments=item["arguments"], name=item["name"])
                yield event("response.output_item.done", output_index=idx, item=item)
            if e.finish_reason:
                finish = e.finish_reason
        for kind in list(open_items):
            for e in close(kind):
                yield e
        resp["status"] = "completed"
        self._finish(resp, finish)
        yield event("response.completed", response=resp)  # also when incomplete (status says so), as vLLM
