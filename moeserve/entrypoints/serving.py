"""What completions and chat share: request fan-out into engine requests, collection, SSE streaming.

One HTTP request becomes len(prompts) * n engine requests ("children"); choice index = prompt * n + i, as
in the OpenAI API. Non-streaming requests gather every child; streaming requests merge the children's
deltas into one event stream. Either way a client that goes away cancels the children, and cancelling a
child aborts it in the engine core (engine_client.generate's finally), which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from moeserve.engine.output_processor import Delta
from moeserve.entrypoints.engine_client import EngineClient, EngineDeadError, EngineRequestError
from moeserve.entrypoints.errors import APIError
from moeserve.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.25
# Tokenizing a prompt (or rendering a chat template) runs off the event loop, so other requests and /health
# keep being answered meanwhile; inputs over BIG_INPUT_CHARS (seconds of work) on a thread of their own, so
# one big request never queues the small ones behind it.
_TOKENIZE = ThreadPoolExecutor(1, thread_name_prefix="moeserve-tokenize")
_TOKENIZE_BIG = ThreadPoolExecutor(1, thread_name_prefix="moeserve-tokenize-big")
BIG_INPUT_CHARS = 1 << 16
# Compiling a structured-output pattern can take a second for a large schema: never on the event loop, and
# not on the tokenizer thread, which other requests wait for.
_GRAMMAR = ThreadPoolExecutor(1, thread_name_prefix="moeserve-grammar")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


class ServerShuttingDown(Exception):
    """SIGTERM's grace period (--shutdown-timeout) ended before this request finished."""


SHUTDOWN_RETRY_AFTER_S = 5
_shutdown: asyncio.Event | None = None  # set when the grace period is over (one API server: one event loop)


def shutdown_event() -> asyncio.Event:
    global _shutdown
    if _shutdown is None:
        _shutdown = asyncio.Event()
    return _shutdown


def end_grace_period() -> None:
    """SIGTERM's grace period is over: the requests still running end now, each with an error naming the
    shutdown (a stream: an error event and [DONE]; a request still waiting: a 503), so the client knows to
    retry, instead of a connection cut with nothing said."""
    shutdown_event().set()


def shutdown_error() -> APIError:
    return APIError("the server is shutting down: its grace period (--shutdown-timeout) ended before this request "
                    "finished; retry it (on another instance, or here once the server is back)", 503,
                    code="server_shutdown", headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


async def _until_shutdown(aw, timeout: float | None = None):
    """Await aw (a coroutine) unless the grace period ends first (ServerShuttingDown) or timeout passes
    (asyncio.TimeoutError); aw is cancelled when it loses (or the caller is cancelled)."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(shutdown_event().wait())
    try:
        done, _ = await asyncio.wait([task, stop], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()  # a Queue.get cancelled leaves its item in the queue
    if task in done:
        return task.result()
    if stop in done:
        raise ServerShuttingDown()
    raise asyncio.TimeoutError()


@dataclass
class Child:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # logprobs requests: each token's start in text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None  # PD: what the request brought (prefill role or KV location)
    kv_transfer_result: dict | None = None  # PD prefill: where its KV now waits, for the decode instance
    slo_ms: tuple = (None, None)  # the request's (TTFT, TPOT) targets for SLO-aware admission
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list | None = None  # TokenLogprobsMsg per prompt token 1.. (prompt_logprobs requests)
    siblings: dict | None = None  # the n samples of one prompt: {"left": unfinished, "max": most tokens}
    priority: int = 0  # --scheduling-policy priority: lower runs first
    cache_salt: str | None = None  # prefix-cache sharing only among requests with the same salt


def chars_per_token_bound(tokenizer) -> int:
    """The most input characters one token can stand for: the longest vocabulary entry (a byte-level
    entry has one character per byte, so this bounds bytes and characters alike), times 4 when a normalizer
    may shrink the text first (Unicode folding). Text longer than max_model_len times this cannot fit."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    folds = backend is not None and backend.normalizer is not None
    return max(1, longest) * (4 if folds else 1)


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine is not available ({e}); the server cannot serve requests", 503,
                        code="engine_dead")
    if isinstance(e, EngineRequestError):
        param = next((f for f in ("logit_bias", "stop_token_ids", "allowed_token_ids", "prompt")
                      if str(e).startswith(f)), None)
        if e.kind == "kv_transfer":  # the prefill instance holding the KV failed us, not the client
            return APIError(str(e), 503, param="kv_transfer_params", code=e.kind)
        if e.kind == "internal":  # the model's own output broke (non-finite logits): not the client's doing
            return APIError(str(e), 500, code="internal_error")
        param = param or ("kv_transfer_params" if str(e).startswith("kv_transfer_params") else None)
        param = param or next((f for f in ("slo_ttft_ms", "slo_tpot_ms") if str(e).startswith(f)), None)
        retry = {"Retry-After": str(int(e.retry_after_s))} if e.retry_after_s is not None else None
        return APIError(str(e), 503 if e.kind == "overloaded" else 400, param=param, code=e.kind, headers=retry)
    if isinstance(e, ServerShuttingDown):
        return shutdown_error()
    if isinstance(e, APIError):
        return e
    return APIError(f"internal server error: {type(e).__name__}: {e}", 500, code="internal_error")


def json_logprob(v: float) -> float:
    """A logprob for JSON, which has no infinity: a token the processed logits mask (--logprobs-mode
    processed_*: -inf) as -9999.0, as vLLM answers it."""
    return max(v, -9999.0)


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class Serving:
    """Base of the completions and chat handlers."""

    # vLLM's ops flags (ServerConfig; api_server.build_app sets the server's): usage on every stream, logprob
    # tokens as "token_id:N", whether usage carries prompt_tokens_details (None: moeserve's default, always)
    force_usage = False
    tokens_as_ids = False
    prompt_details: bool | None = None

    def __init__(self, client: EngineClient, tokenizer, model_name: str, max_model_len: int,
                 max_waiting_requests: int | None = None, default_sampling: dict | None = None) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.model_aliases: tuple[str, ...] = ()  # --served-model-name's further names
        self.max_waiting = max_waiting_requests
        self.default_sampling = default_sampling or {}  # --generation-config (generation_defaults.py)
        self.token_chars = chars_per_token_bound(tokenizer)

    @staticmethod
    async def off_loop(fn, *args, size: int = 0):
        """Run tokenizer work (on input of `size` characters) on a tokenizer thread; its APIError reaches the
        caller unchanged."""
        pool = _TOKENIZE_BIG if size > BIG_INPUT_CHARS else _TOKENIZE
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    def check_text_size(self, num_chars: int, what: str = "prompt", param: str = "prompt") -> None:
        """Before tokenizing: refuse text that cannot fit the context whatever its tokens (each covers at most
        token_chars characters), so megabytes are never tokenized only to be refused."""
        if num_chars > self.max_model_len * self.token_chars:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens, but the {what} "
                           f"has {num_chars} characters, more than that many tokens can hold (a token covers at "
                           f"most {self.token_chars}); shorten it", param=param, code="context_length_exceeded")

    async def sampling_params(self, req, *args):
        """req.sampling_params(*args) with the server's defaults, on the grammar thread when it compiles a
        structured-output pattern."""
        call = functools.partial(req.sampling_params, *args, defaults=self.default_sampling)
        if not req.has_structured_outputs:
            return call()
        return await asyncio.get_running_loop().run_in_executor(_GRAMMAR, call)

    # ---- validation ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
            raise APIError(f"the model '{model}' does not exist; this server serves '{self.model_name}' "
                           "(see /v1/models)", 400, param="model", code="model_not_found")

    def check_length(self, num_prompt: int, max_tokens: int | None, what: str = "prompt",
                     field: str = "max_tokens") -> int:
        """The request's max_tokens (None -> fill the context); 400 if it cannot fit the context."""
        if num_prompt == 0:
            raise APIError(f"the {what} is empty", param="prompt")
        limit = self.max_model_len
        if num_prompt >= limit:
            raise APIError(f"this model's maximum context length is {limit} tokens, but the {what} has "
                           f"{num_prompt} tokens; shorten it", param="prompt", code="context_length_exceeded")
        if max_tokens is None:  # the rest of the context, or the checkpoint's max_new_tokens when smaller
            return min(limit - num_prompt, self.default_sampling.get("max_tokens", limit))
        if max_tokens < 1:
            raise APIError(f"{field} must be at least 1, got {max_tokens}", param=field)
        if num_prompt + max_tokens > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens, but {num_prompt + max_tokens} "
                           f"were requested ({num_prompt} in the {what}, {max_tokens} in the completion); "
                           f"reduce the length of the prompt or {field}", param=field,
                           code="context_length_exceeded")
        return max_tokens

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")

    def truncate(self, ids: list[int], req) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (truncation_side "right": the first)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.max_model_len if k == -1 else k
        if k == 0:
            raise APIError("'truncate_prompt_tokens' must keep at least one token", param="truncate_prompt_tokens")
        if len(ids) <= k:
            return ids
        return ids[-k:] if req.truncation_side == "left" else ids[:k]

    def make_children(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                      kv_transfer_params: dict | None = None, stream: bool = False, req=None) -> list[Child]:
        if kv_transfer_params is not None:
            kvt = self.check_kv_transfer(kv_transfer_params, len(prompts), params.n, stream)
            if kvt.do_remote_decode:
                # A decode instance generates the answer; this one computes the prompt and one token. The
                # request was checked with the client's max_tokens first, so what the decode instance would
                # refuse (a prompt + max_tokens over the context) is refused before KV is held for it.
                params = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        if self.max_waiting is not None and len(prompts) * params.n > self.max_waiting:
            # Every child waits in the engine at first; more than the queue holds could never be admitted.
            raise APIError(f"this request needs {len(prompts) * params.n} engine requests ({len(prompts)} prompts "
                           f"x n={params.n}), more than the server's --max-waiting-requests {self.max_waiting}; "
                           "send fewer prompts or a smaller n", param="n")
        base = f"{prefix}-{uuid.uuid4().hex}"
        children = []
        for p, ids in enumerate(prompts):
            siblings = {"left": params.n, "max": 0}
            for i in range(params.n):
                child = params.for_sample(i)
                children.append(Child(p * params.n + i, f"{base}-{p}-{i}", ids, child,
                                      kv_transfer_params=kv_transfer_params, slo_ms=getattr(req, "slo_ms", (None, None)),
                                      priority=getattr(req, "priority", 0), cache_salt=getattr(req, "cache_salt", None),
                                      siblings=siblings))
        return children

    @staticmethod
    def check_kv_transfer(raw: dict, num_prompts: int, n: int, stream: bool):
        """kv_transfer_params name one engine request's KV: one prompt, n 1; a prefill answer is JSON."""
        from moeserve.disagg.params import KVTransferParams, KVTransferParamsError
        try:
            kvt = KVTransferParams.parse(raw)
        except KVTransferParamsError as e:
            raise APIError(str(e), param="kv_transfer_params") from None
        if num_prompts != 1 or n != 1:
            # Through `moeserve proxy` the client never sent kv_transfer_params: name what it can change.
            what = f"n={n}" if n != 1 else f"{num_prompts} prompts"
            raise APIError(f"prefill/decode disaggregation serves one sequence per request, this one asks for "
                           f"{what}: send one prompt with n 1 (or several requests)",
                           param="n" if n != 1 else "prompt")
        if kvt.do_remote_decode and stream:
            raise APIError("kv_transfer_params.do_remote_decode needs 'stream': false (the answer carries "
                           "kv_transfer_params for the decode instance)", param="stream")
        return kvt

    @staticmethod
    def kv_transfer_field(children: list[Child]) -> dict:
        """The response's kv_transfer_params (vLLM's field), present when the request brought some."""
        if children[0].kv_transfer_params is None:
            return {}
        return {"kv_transfer_params": children[0].kv_transfer_result}

    # ---- running ---------------------------------------------------------------------------------
    async def _run_child(self, child: Child, sink: asyncio.Queue | None) -> Child:
        async for delta in self.client.generate(child.request_id, child.prompt_ids, child.params,
                                                child.kv_transfer_params, child.slo_ms, priority=child.priority,
                                                cache_salt=child.cache_salt):
            if delta.kv_transfer_params is not None:
                child.kv_transfer_result = delta.kv_transfer_params
            child.num_cached_tokens = max(child.num_cached_tokens, delta.num_cached_tokens)
            if delta.prompt_logprobs is not None:
                child.prompt_logprobs = delta.prompt_logprobs
            child.text += delta.text
            child.token_ids.extend(delta.token_ids)
            child.logprobs.extend(delta.logprobs)
            child.text_offsets.extend(delta.text_offsets)
            if delta.finished:
                child.finish_reason, child.stop_reason = delta.finish_reason, delta.stop_reason
                self._sample_finished(child)
            if sink is not None:
                sink.put_nowait((child, delta))
        return child

    def _sample_finished(self, child: Child) -> None:
        """vllm:request_max_num_generation_tokens: once all n samples of a prompt finished, the most tokens one
        of them generated (vLLM records it per request, its parallel samples together)."""
        group = child.siblings
        if group is None:
            return
        group["left"] -= 1
        group["max"] = max(group["max"], len(child.token_ids))
        metrics = getattr(self.client, "metrics", None)
        if group["left"] == 0 and metrics is not None:
            metrics.observe_max_generation(group["max"])

    async def collect(self, children: list[Child], raw: Request) -> list[Child]:
        """Run every child to the end; cancel all of them if one fails or the client disconnects."""
        tasks = [asyncio.create_task(self._run_child(c, None)) for c in children]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if t.exception() is not None:
                        raise engine_error(t.exception())
                if not pending:
                    return children
                if shutdown_event().is_set():
                    raise shutdown_error()
                if await raw.is_disconnected():
                    raise ClientDisconnected()
        finally:
            for t in tasks:
                t.cancel()

    async def stream(self, children: list[Child], raw: Request, chunks) -> StreamingResponse | JSONResponse:
        """SSE of the merged children. chunks: async generator (events queue, tasks) -> SSE strings.

        Headers wait for the first event, so a request the engine refuses still gets its 4xx/503 status.
        """
        events: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._forward(c, events)) for c in children]
        try:
            first = await self._first_event(events, raw)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if isinstance(first[1], Exception):
            for t in tasks:
                t.cancel()
            raise engine_error(first[1])

        async def body():
            try:
                async for s in chunks(first, events, len(children)):
                    yield s
            finally:  # the client went away or we are done: stop every child
                for t in tasks:
                    t.cancel()

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _forward(self, child: Child, events: asyncio.Queue) -> None:
        try:
            await self._run_child(child, events)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever it is, the waiting client must hear of it, not hang
            events.put_nowait((child, e))

    @staticmethod
    async def _first_event(events: asyncio.Queue, raw: Request):
        while True:
            try:
                return await _until_shutdown(events.get(), DISCONNECT_POLL_S)
            except ServerShuttingDown:
                raise shutdown_error() from None
            except asyncio.TimeoutError:
                if await raw.is_disconnected():
                    raise ClientDisconnected() from None

    @staticmethod
    async def merged(first, events: asyncio.Queue, num_children: int):
        """Yield (child, delta_or_error) until every child finished (or one failed, or the shutdown's grace
        period ended: a ServerShuttingDown error)."""
        remaining = num_children
        item = first
        while True:
            child, delta = item
            yield child, delta
            if isinstance(delta, Exception):
                return
            if delta.finished:
                remaining -= 1
                if remaining == 0:
                    return
            try:
                item = events.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    item = await _until_shutdown(events.get())
                except ServerShuttingDown as e:
                    item = (child, e)

    # ---- formatting ------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=65536)
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def prompt_logprobs_field(self, c: Child, n: int) -> list:
        """vLLM's prompt_logprobs shape (completions: per choice; chat: top level): None for the first prompt
        token, then {token id: {logprob, decoded_token}} with the top n and the prompt's own token."""
        out: list = [None]
        for lp in c.prompt_logprobs or []:
            top = dict(lp.top[:n])  # best first (topk)
            top.setdefault(lp.token_id, lp.logprob)
            out.append({str(t): {"logprob": v, "decoded_token": self.token_str(t)} for t, v in top.items()})
        return out

    def include_usage(self, req) -> bool:
        """A stream's last chunk carries usage: stream_options.include_usage, or --enable-force-include-usage."""
        return self.force_usage or req.include_usage

    def as_token_ids(self, req) -> bool:
        """Logprob tokens as "token_id:N": the request's return_tokens_as_token_ids, else the server's flag."""
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.tokens_as_ids if asked is None else asked

    def logprob_token(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.token_str(token_id)

    def usage(self, num_prompt_tokens: int, children: list[Child]) -> dict:
        completion = sum(len(c.token_ids) for c in children)
        # Per prompt the most any of its n samples found cached (prompt_tokens counts each prompt once).
        cached: dict[int, int] = {}
        for c in children:
            cached[id(c.prompt_ids)] = max(cached.get(id(c.prompt_ids), 0), c.num_cached_tokens)
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": num_prompt_tokens + completion,
                "prompt_tokens_details": None if self.prompt_details is False else
                {"cached_tokens": sum(cached.values())}}

    @staticmethod
    def error_event(e: Exception) -> str:
        err = engine_error(e)
        return sse(err.body())

    @staticmethod
    def created() -> int:
        return int(time.time())


def delta_is_empty(d: Delta) -> bool:
    return not d.text and not d.token_ids and not d.finished
