"""/v1/chat/completions: messages rendered with the tokenizer's chat template (moeserve/chat_template.py)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.chat_template import ChatTemplateError, render, resolve_template
from moeserve.entrypoints.chat_events import ChoiceDelta, ChoiceStarted, Failed, Usage
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import ChatCompletionRequest
from moeserve.entrypoints.reasoning import THINK_END, StreamedReasoning, split_reasoning, thinks
from moeserve.entrypoints.serving import Serving, json_logprob, sse
from moeserve.entrypoints.tool_calls import StreamedContent, ToolCall, parse_deepseek_v3, parse_required


class ChatServing(Serving):
    response_role = "assistant"  # --response-role (api_server.build_app sets the server's)

    def __init__(self, *args, chat_template: str | None = None, auto_tools: bool = False,
                 reasoning_parser: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = resolve_template(self.tokenizer, chat_template)
        self.auto_tools = auto_tools  # --enable-auto-tool-choice with a --tool-call-parser
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (entrypoints/reasoning.py)
        self.think_end_ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)  # thinking_token_budget

    def render(self, req: ChatCompletionRequest) -> list[int]:
        kwargs = req.template_kwargs()
        if req.continue_final_message:
            kwargs = {**(kwargs or {}), "continue_final_message": True}
        return self.truncate(self.render_messages(req.messages, req.add_generation_prompt, req.tool_dicts(),
                                                  kwargs), req)

    def render_messages(self, messages: list, add_generation_prompt: bool, tools: list[dict] | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
        conversation = [m.template_fields() for m in messages]
        try:
            return render(self.tokenizer, conversation, self.chat_template, add_generation_prompt, tools,
                          template_kwargs)[1]
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None

    def check_messages_size(self, messages: list) -> int:
        """The messages' characters (every one is in the rendered prompt), refused when they cannot fit."""
        size = sum(len(m.text()) for m in messages)
        self.check_text_size(size, "messages", "messages")
        return size

    async def create(self, req: ChatCompletionRequest, raw: Request, encode=None):
        """The chat answer: JSON, or a stream of the typed events written by encode(events) (default: chat
        completion chunks; /v1/responses and /v1/messages pass their own)."""
        self.check_model(req.model)
        req.check()
        mode = req.tool_mode(self.auto_tools)
        think = thinks(self.reasoning_parser, req.template_kwargs())
        size = self.check_messages_size(req.messages)
        ids = await self.off_loop(self.render, req, size=size)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.check_length(len(ids), getattr(req, field), "messages", field)
        params = await self.sampling_params(req, max_tokens, req.num_logprobs(), req.prompt_logprobs)
        if think and params.structured_outputs is not None:  # the pattern (or tool schema) starts after thinking
            params.structured_outputs.after = THINK_END
        self._thinking_budget(params, think)
        children = self.make_children([ids], params, "chatcmpl", req.kv_transfer_params, req.stream, req)
        rid, created = children[0].request_id.rsplit("-", 2)[0], self.created()
        if req.stream:
            encode = encode or (lambda events: self._chat_sse(req, rid, created, events))

            def chunks(first, events, n):
                return encode(self._events(req, first, events, n, len(ids), children, mode, think))
            return await self.stream(children, raw, chunks)
        await self.collect(children, raw)
        choices = []
        for c in children:
            reasoning, text = split_reasoning(c.text) if think else (None, c.text)
            message, finish = self._message(req, mode, text or "", c.finish_reason)
            if think:
                message["reasoning_content"] = reasoning
                if text is None and message["content"] == "":
                    message["content"] = None
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.logprobs, self.as_token_ids(req)) if req.logprobs else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason,
                            **({"token_ids": c.token_ids} if req.return_token_ids else {})})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self.usage(len(ids), children),
                             **self._prompt_field(req, children[0]), **self.kv_transfer_field(children),
                             **({"prompt_token_ids": ids} if req.return_token_ids else {})})

    def _thinking_budget(self, params, think: bool) -> None:
        """thinking_token_budget (vLLM's): counted from the output's start, which is thinking when the reasoning
        parser says so; a request that does not think has no thinking to bound."""
        if params.thinking_token_budget is None:
            return
        if self.reasoning_parser is None:
            raise APIError("thinking_token_budget needs a server started with --reasoning-parser (it bounds the "
                           "reasoning that parser splits off)", param="thinking_token_budget")
        if not think:
            params.thinking_token_budget = None
        else:
            params.thinking_end_token_ids = self.think_end_ids

    def _prompt_field(self, req: ChatCompletionRequest, c) -> dict:
        """vLLM's chat answer carries prompt_logprobs at the top level: every choice has the same prompt."""
        return {"prompt_logprobs": self.prompt_logprobs_field(c, req.prompt_logprobs)} \
            if req.prompt_logprobs is not None else {}

    @staticmethod
    def _calls(mode: str | None, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """(content, calls) of a finished choice; calls None when the text holds none (plain, or cut off)."""
        if mode == "named":
            return None, None  # the caller names the function
        if mode == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, None)
        if mode == "auto":
            content, calls = parse_deepseek_v3(text)
            return content, calls or None
        return text, None

    def _message(self, req, mode: str | None, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message and finish_reason: tool calls as OpenAI's tool_calls (finish_reason
        "tool_calls", except for a named function, where OpenAI says "stop")."""
        # No text: a thinking request that stopped (EOS) before </think>, so the schema never applied.
        if mode == "named" and finish == "stop" and text:
            return {"role": self.role(req), "content": None,
                    "tool_calls": [ToolCall(req.tool_choice.function.name, text).to_openai()]}, finish
        content, calls = self._calls(mode, text)
        if calls is None:
            return {"role": self.role(req), "content": content}, finish
        return {"role": self.role(req), "content": content, "tool_calls": [c.to_openai() for c in calls]}, \
            "tool_calls" if finish == "stop" else finish

    def _entry(self, token_id: int, logprob: float, as_ids: bool) -> dict:
        tok = self.logprob_token(token_id, as_ids)
        return {"token": tok, "logprob": json_logprob(logprob), "bytes": list(tok.encode("utf-8"))}

    def _logprobs(self, lps, as_ids: bool = False) -> dict:
        return {"content": [{**self._entry(lp.token_id, lp.logprob, as_ids),
                             "top_logprobs": [self._entry(t, v, as_ids) for t, v in lp.top]} for lp in lps]}

    def role(self, req) -> str:
        """vLLM's: --response-role for a generation prompt, else the role of the message being continued."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    async def _events(self, req, first, events, n, num_prompt, children, mode=None, think=False):
        """The merged children's engine deltas as typed chat events (chat_events.py)."""
        started: set[int] = set()
        # Tool modes: "named"/"required" outputs are JSON that becomes calls, sent when the choice ends;
        # "auto" streams content until DeepSeek's call marker, then holds the rest for the parser.
        held: dict[int, str] = {}
        auto: dict[int, StreamedContent] = {}
        thinking: dict[int, StreamedReasoning] = {}  # --reasoning-parser: text up to </think> is reasoning
        async for child, delta in self.merged(first, events, n):
            if isinstance(delta, Exception):
                yield Failed(delta)
                return
            if child.index not in started:  # the response's first choice carries the prompt_logprobs
                prompt = self._prompt_field(req, child) if not started else {}
                started.add(child.index)
                yield ChoiceStarted(child.index, self.role(req), prompt,
                                    child.prompt_ids if req.return_token_ids else None)
            text, calls, reasoning = delta.text, None, ""
            if think:
                split = thinking.setdefault(child.index, StreamedReasoning())
                reasoning, text = split.push(text)
                if delta.finished:
                    reasoning += split.finish()
            if mode in ("named", "required"):
                held[child.index] = held.get(child.index, "") + text
                text = ""
            elif mode == "auto":
                text = auto.setdefault(child.index, StreamedContent()).push(text)
            finish = delta.finish_reason if delta.finished else None
            if delta.finished and mode is not None:
                text, calls, finish = self._final_delta(req, mode, child.index, held, auto, text, finish)
            yield ChoiceDelta(child.index, text, reasoning, calls, delta.logprobs if req.logprobs else None,
                              delta.finished, finish, delta.stop_reason if delta.finished else None,
                              delta.token_ids if req.return_token_ids else None)
        yield Usage(self.usage(num_prompt, children))

    async def _chat_sse(self, req, rid: str, created: int, events):
        """Typed chat events -> chat.completion.chunk SSE, [DONE] last."""
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        usage_null = {"usage": None} if self.include_usage(req) else {}
        async for e in events:
            if isinstance(e, Failed):
                yield self.error_event(e.error)
                break
            if isinstance(e, ChoiceStarted):  # the first chunk of each choice carries the role
                role = {"index": e.index, "delta": {"role": e.role, "content": ""}, "logprobs": None,
                        "finish_reason": None}
                ids = {"prompt_token_ids": e.prompt_token_ids} if e.prompt_token_ids is not None else {}
                yield sse({**head, "choices": [role], **e.prompt_logprobs, **ids, **usage_null})
            elif isinstance(e, ChoiceDelta):
                out = {}
                if e.reasoning:
                    out["reasoning_content"] = e.reasoning
                if e.content:
                    out["content"] = e.content
                if e.tool_calls:
                    out["tool_calls"] = e.tool_calls
                choice = {"index": e.index, "delta": out,
                          "logprobs": self._logprobs(e.logprobs, self.as_token_ids(req)) if req.logprobs else None,
                          "finish_reason": e.finish_reason}
                if e.finished:
                    choice["stop_reason"] = e.stop_reason
                if e.token_ids is not None:
                    choice["token_ids"] = e.token_ids
                yield sse({**head, "choices": [choice], **usage_null})
            elif isinstance(e, Usage) and self.include_usage(req):
                yield sse({**head, "choices": [], "usage": e.usage})
        yield "data: [DONE]\n\n"

    def _final_delta(self, req, mode, index, held, auto, text, finish):
        """(content still to send, the tool_calls delta entries or None, finish_reason) when a tool-mode choice
        ends."""
        if mode == "auto":
            rest, calls = auto.setdefault(index, StreamedContent()).finish()
            text += rest
            if not calls:
                return text, None, finish
            return text, [c.to_openai(i) for i, c in enumerate(calls)], "tool_calls" if finish == "stop" else finish
        message, finish = self._message(req, mode, held.pop(index, ""), finish)
        calls = message.get("tool_calls")
        if not calls:
            return message["content"] or "", None, finish
        return "", [{"index": i, **c} for i, c in enumerate(calls)], finish
