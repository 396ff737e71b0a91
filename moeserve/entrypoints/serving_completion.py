"""/v1/completions: prompt as a string, a list of strings, token ids or a list of token-id lists."""
from __future__ import annotations

import functools

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.engine.output_processor import complete_part
from moeserve.entrypoints.errors import APIError
from moeserve.entrypoints.openai_protocol import CompletionRequest
from moeserve.entrypoints.serving import Child, Serving, json_logprob, sse


def token_offsets(decode, ids: list[int]) -> tuple[list[int], int]:
    """(character offset of each token's start, length of the whole text) for ids, by the rule of the
    output processor's offsets (a token that finishes a character starts at it), in linear time: the ids
    are decoded in short runs that end on a character boundary, not as ever longer prefixes."""
    offsets, done, start = [], 0, 0
    for i in range(len(ids)):
        piece = decode(ids[start:i]) if start < i else ""
        offsets.append(done + len(complete_part(piece)))
        if not piece.endswith("\ufffd"):  # a character boundary: later runs start here
            done, start = done + len(piece), i
    return offsets, done + len(decode(ids[start:]))


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        req.check()
        texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
        for t in texts:
            self.check_text_size(len(t))
        prompts = await self.off_loop(self._prompts, req.prompt, req.add_special_tokens, size=sum(map(len, texts)))
        prompts = [(t, self.truncate(ids, req)) for t, ids in prompts]
        scoring = req.max_tokens == 0  # echo with max_tokens 0: the prompt's logprobs, nothing generated
        asked = 1 if scoring else req.max_tokens
        if "max_tokens" not in req.model_fields_set and asked is not None:  # the default 16: the file's
            asked = min(asked, self.default_sampling.get("max_tokens", asked))  # max_new_tokens caps it (vLLM)
        max_tokens = min(self.check_length(len(ids), asked) for _, ids in prompts)
        # echo with logprobs scores the prompt too (OpenAI's legacy completions; lm-eval's loglikelihood)
        prompt_lps = max((n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None),
                         default=None)
        params = await self.sampling_params(req, max_tokens if req.max_tokens is not None else None, req.logprobs,
                                           prompt_lps)
        children = self.make_children([ids for _, ids in prompts], params, "cmpl", req.kv_transfer_params,
                                      req.stream, req)
        texts = [t for t, _ in prompts]
        num_prompt = sum(len(ids) for _, ids in prompts)
        rid, created = children[0].request_id.rsplit("-", 2)[0], self.created()
        if req.stream:
            def chunks(first, events, n):
                return self._chunks(req, rid, created, texts, first, events, n, num_prompt, children)
            return await self.stream(children, raw, chunks)
        await self.collect(children, raw)
        if scoring:  # the one token that computed the prompt's logits is not part of the answer
            for c in children:
                c.text, c.token_ids, c.logprobs, c.text_offsets, c.finish_reason = "", [], [], [], "length"
        choices = [self._choice(req, c, texts[c.index // req.n]) for c in children]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self.usage(num_prompt, children),
                             **self.kv_transfer_field(children)})

    def _prompts(self, prompt, add_special_tokens: bool = True) -> list[tuple[str, list[int]]]:
        """[(prompt text, token ids)] for each prompt of the request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens)))
            else:
                if not p:
                    raise APIError("a token-id prompt must not be empty", param="prompt")
                self.check_token_ids(p)
                out.append((self.tokenizer.decode(p), list(p)))
        return out

    def _choice(self, req: CompletionRequest, c: Child, prompt_text: str) -> dict:
        prefix = prompt_text if req.echo else ""
        text = prefix + c.text
        lp = None
        if req.logprobs is not None:
            # min: tokens that began a stop string later cut off start at the text's end
            offsets = [min(len(prefix) + o, len(text)) for o in c.text_offsets]
            lp = self._logprobs(c.logprobs, offsets, self._echoed(req, c, prefix), self.as_token_ids(req))
        choice = {"index": c.index, "text": text, "logprobs": lp,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_field(c, req.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = c.prompt_ids, c.token_ids
        return choice

    def _echoed(self, req: CompletionRequest, c: Child, prompt_text: str) -> tuple[list[int], list, list] | None:
        """With echo and logprobs the prompt's tokens lead the logprobs (the first one has none)."""
        if not (req.echo and req.logprobs is not None):
            return None
        return c.prompt_ids, self._top(c.prompt_logprobs or [], req.logprobs), self._prompt_offsets(c.prompt_ids,
                                                                                                   prompt_text)

    def _prompt_offsets(self, ids: list[int], text: str) -> list[int]:
        """text_offset of each prompt token in the echoed prompt text. That text is what the client sent (a
        BOS the tokenizer added is not in it) or, for token ids, their decoding with special tokens: the
        decoding whose length matches is used."""
        for skip in (False, True):
            offsets, end = token_offsets(functools.partial(self.tokenizer.decode, skip_special_tokens=skip), ids)
            if end == len(text):
                break
        return [min(o, len(text)) for o in offsets]

    @staticmethod
    def _top(lps: list, n: int) -> list:
        """Prompt entries carry max(prompt_logprobs, logprobs) alternatives, best first: keep n."""
        return [type(lp)(lp.token_id, lp.logprob, lp.top[:n]) for lp in lps]

    def _logprobs(self, lps, offsets: list[int], echoed: tuple[list[int], list, list] | None = None,
                  as_ids: bool = False) -> dict:
        """OpenAI's legacy logprobs. text_offset: where each token starts in the choice's text, in characters
        (the output processor's offsets; for an echoed prompt, _prompt_offsets)."""
        tokens, token_lps, tops = [], [], []
        if echoed is not None:  # the prompt: its first token has no logprob (None), as OpenAI reports it
            ids, prompt_lps, prompt_offsets = echoed
            lps, offsets = list(prompt_lps) + list(lps), prompt_offsets + list(offsets)
            tokens.append(self.logprob_token(ids[0], as_ids))
            token_lps.append(None)
            tops.append(None)
        for lp in lps:
            tok = self.logprob_token(lp.token_id, as_ids)
            tokens.append(tok)
            token_lps.append(json_logprob(lp.logprob))
            top = {self.logprob_token(t, as_ids): json_logprob(v) for t, v in lp.top}
            top.setdefault(tok, json_logprob(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": list(offsets)}

    async def _chunks(self, req, rid, created, texts, first, events, n, num_prompt, children):
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        usage_null = {"usage": None} if self.include_usage(req) else {}
        echoed: set[int] = set()
        ids_sent: set[int] = set()  # return_token_ids: the choices whose prompt_token_ids went out
        async for child, delta in self.merged(first, events, n):
            if isinstance(delta, Exception):
                yield self.error_event(delta)
                break
            text = delta.text
            if req.echo and child.index not in echoed:
                echoed.add(child.index)
                text = texts[child.index // req.n] + text
            lp = None
            if req.logprobs is not None:
                first = delta.prompt_logprobs is not None
                prompt_text = texts[child.index // req.n] if req.echo else ""
                lp = self._logprobs(delta.logprobs, [len(prompt_text) + o for o in delta.text_offsets],
                                    self._echoed(req, child, prompt_text) if first else None, self.as_token_ids(req))
            choice = {"index": child.index, "text": text, "logprobs": lp,
                      "finish_reason": delta.finish_reason if delta.finished else None,
                      "stop_reason": delta.stop_reason if delta.finished else None}
            if req.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_field(child, req.prompt_logprobs)
            if req.return_token_ids:  # vLLM's: the prompt's ids with each choice's first chunk, then null
                choice["prompt_token_ids"] = child.prompt_ids if child.index not in ids_sent else None
                choice["token_ids"] = delta.token_ids
                ids_sent.add(child.index)
            yield sse({**head, "choices": [choice], **usage_null})
        else:
            if self.include_usage(req):
                yield sse({**head, "choices": [], "usage": self.usage(num_prompt, children)})
        yield "data: [DONE]\n\n"
