"""/v1/chat/completions: messages rendered with the tokenizer's chat template (moeserve/chat_template.py)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.chat_template import ChatTemplateError, render, resolve_template
from moeserve.entrypoints.openai_protocol import APIError, ChatCompletionRequest
from moeserve.entrypoints.serving import Serving, sse


class ChatServing(Serving):
    def __init__(self, *args, chat_template: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = resolve_template(self.tokenizer, chat_template)

    def render(self, req: ChatCompletionRequest) -> list[int]:
        return self.render_messages(req.messages, req.add_generation_prompt)

    def render_messages(self, messages: list, add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in messages]
        try:
            return render(self.tokenizer, conversation, self.chat_template, add_generation_prompt)[1]
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None

    async def create(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        ids = await self.off_loop(self.render, req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.check_length(len(ids), getattr(req, field), "messages", field)
        params = await self.sampling_params(req, max_tokens, req.num_logprobs())
        children = self.make_children([ids], params, "chatcmpl", req.kv_transfer_params, req.stream)
        rid, created = children[0].request_id.rsplit("-", 2)[0], self.created()
        if req.stream:
            def chunks(first, events, n):
                return self._chunks(req, rid, created, first, events, n, len(ids), children)
            return await self.stream(children, raw, chunks)
        await self.collect(children, raw)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.logprobs) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in children]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self.usage(len(ids), children),
                             **self.kv_transfer_field(children)})

    def _entry(self, token_id: int, logprob: float) -> dict:
        tok = self.token_str(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    def _logprobs(self, lps) -> dict:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in lps]}

    async def _chunks(self, req, rid, created, first, events, n, num_prompt, children):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        usage_null = {"usage": None} if req.include_usage else {}
        started: set[int] = set()
        async for child, delta in self.merged(first, events, n):
            if isinstance(delta, Exception):
                yield self.error_event(delta)
                break
            if child.index not in started:  # the first chunk of each choice carries the role
                started.add(child.index)
                role = {"index": child.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                yield sse({**head, "choices": [role], **usage_null})
            choice = {"index": child.index, "delta": {"content": delta.text} if delta.text else {},
                      "logprobs": self._logprobs(delta.logprobs) if req.logprobs else None,
                      "finish_reason": delta.finish_reason if delta.finished else None}
            if delta.finished:
                choice["stop_reason"] = delta.stop_reason
            yield sse({**head, "choices": [choice], **usage_null})
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage(num_prompt, children)})
        yield "data: [DONE]\n\n"
