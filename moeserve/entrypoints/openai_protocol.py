"""OpenAI API request models (pydantic, strict types) and the error body, as the OpenAI API defines them.

Requests are validated strictly from the raw JSON: a string where a number belongs is a 400, not a silent
coercion. Unknown fields are ignored (clients send extras). Range checks live in SamplingParams, which
gives the same messages offline and online.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moeserve.config import MAX_SLO_MS
from moeserve.entrypoints.errors import APIError, validation_error
from moeserve.sampling_params import SamplingParams, SamplingParamsError
from moeserve.structured.params import StructuredOutputsParams, compile_params
from moeserve.structured.errors import PatternError

_log = logging.getLogger("moeserve.requests")

MAX_N = 128  # choices per request; each one is a separate engine request
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,18}", re.ASCII)  # a logit_bias key: ASCII digits, no sign or leading 0
MAX_LOGPROBS = 20



JSON_MAX_DEPTH = 200  # pydantic-core's parser refuses JSON nested deeper (its recursion limit)


def parse_json(data: bytes | str) -> object:
    """A request body's JSON, by the one parser every route uses: pydantic-core's, the one
    model_validate_json runs, whose nesting is bounded (JSON nested 1,000 deep is a 400, not a
    RecursionError) and whose integers are (thousands of digits are refused, not converted). Non-finite
    numbers are refused as well: NaN and Infinity are not JSON, and a literal beyond the float range (1e999)
    would become inf, which no field takes and JSON cannot re-encode. Raises APIError (400, invalid_json)."""
    try:
        value = pydantic_core.from_json(data, allow_inf_nan=True)
    except ValueError as e:
        if "recursion limit" in str(e):
            raise APIError(f"the request body is nested too deeply: JSON arrays and objects may nest at most "
                           f"{JSON_MAX_DEPTH} levels; flatten it", code="invalid_json") from None
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    bad = _non_finite(value)
    if bad is not None:
        path, x = bad
        what = "NaN" if math.isnan(x) else "infinite" if x > 0 else "minus infinite"
        raise APIError(f"'{path}' is {what} in the request body: NaN, Infinity and numbers beyond the float range "
                       "(such as 1e999) are not accepted; send a finite number", param=path.split(".")[0],
                       code="invalid_json")
    return value


def _non_finite(value) -> tuple[str, float] | None:
    """The dotted path and value of the first NaN or infinite float in parsed JSON (nesting is bounded)."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return path or "(the body)", v
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in reversed(list(enumerate(v))))
    return None


def chat_request_from(chat: dict, body: dict, passthrough: tuple[str, ...]) -> "ChatCompletionRequest":
    """Another API's request (/v1/responses, /v1/messages) as the chat request it is served by: `chat` holds
    the translated fields, `passthrough` names the body's fields that keep their chat meaning when set."""
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # their final event carries the usage
    chat.update({k: body[k] for k in passthrough if body.get(k) is not None})
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise validation_error(e) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data):
        # The OpenAI API lets clients send null for any optional field: it means "use the default".
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        """vLLM's: the fields a request sent that no model field reads (OpenAI's store, metadata,
        service_tier, a client's own extras) are ignored, and named in one DEBUG line per request."""
        result = handler(data)
        if isinstance(data, dict):
            ignored = sorted(set(data) - set(cls.model_fields))
            if ignored:
                _log.debug("The following fields were present in the request but ignored: %s", ignored)
        return result


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    # Guided decoding, vLLM's extras: structured_outputs {"json" | "regex" | "choice" | "json_object": ...},
    # and the older guided_* fields (guided_decoding_backend is accepted and ignored: there is one backend).
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    user: str | None = None
    kv_transfer_params: dict | None = None  # PD disaggregation (vLLM's extension; disagg/params.py)
    # SLO-aware admission targets (engine/slo.py; moeserve's extension): None = the server's --slo-*-ms
    slo_ttft_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, allow_inf_nan=False)
    slo_tpot_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, allow_inf_nan=False)

    @property
    def slo_ms(self) -> tuple[float | None, float | None]:
        return self.slo_ttft_ms, self.slo_tpot_ms

    # vLLM's extras (docs/from-vllm.md); entrypoints/vllm_fields.py refuses the ones not served
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # the answer carries prompt_token_ids and each choice's token_ids; streamed: each chunk the ids of its delta,
    # the prompt's on the first chunk (completions: each choice's first; chat: each choice's role chunk)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N" (None: the server's flag)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep this many prompt tokens (-1: the context)
    truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)  # --scheduling-policy priority: lower runs first
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache sharing only among requests with this salt

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data):
        from moeserve.entrypoints.vllm_fields import refuse_unserved
        refuse_unserved(data, cls.__name__, cls.model_fields)
        return data

    def _unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, i.e. strings."""
        if not self.logit_bias:
            return None
        # Plain ASCII decimals only: int() also reads "１２" (fullwidth), "1_000", " 12" and "+12".
        bad = next((k for k in self.logit_bias if not _TOKEN_ID.fullmatch(k)), None)
        if bad is not None:
            raise APIError(f"logit_bias keys must be token ids written as plain decimal numbers, e.g. "
                           f"{{\"1234\": -100}}; got {bad[:40]!r}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    @property
    def has_structured_outputs(self) -> bool:
        return bool(self._constraints())

    def _constraints(self) -> list[tuple[str, dict]]:
        """(request field, StructuredOutputsParams keywords) of every structured-output constraint asked for
        (response_format, structured_outputs, guided_*, chat's tool_choice), uncompiled."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            kind = rf.get("type")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                    raise APIError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                   "\"schema\": {...}}}", param="response_format")
                given.append(("response_format", {"json": spec["schema"]}))
            elif kind == "structural_tag":
                given.append(("response_format", {"structural_tag": _structural_tag_format(rf)}))
            else:
                raise APIError(f"response_format type {kind!r} is not supported; use \"text\", \"json_object\", "
                               "\"json_schema\" or \"structural_tag\"", param="response_format")
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                given.append((field, {key: getattr(self, field)}))
        return given + self._tool_constraint()

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint, compiled to check it."""
        given = self._constraints()
        if not given:
            return None
        if len(given) > 1:
            raise APIError(f"give one structured-output constraint, not {' and '.join(f for f, _ in given)}",
                           param=given[1][0])
        field, spec = given[0]
        try:
            try:
                params = StructuredOutputsParams(**spec)
            except TypeError:  # an unknown key (only this call: a TypeError while compiling is another bug)
                raise APIError(f"'{field}' takes the keys json, regex, choice, json_object, grammar, structural_tag; got "
                               f"{sorted(spec)}", param=field) from None
            compile_params(params)
        except PatternError as e:
            raise self._pattern_error(field, e) from None
        return params

    def _pattern_error(self, field: str, e: PatternError) -> APIError:
        return APIError(f"'{field}': {e}", param=field)

    def _tool_constraint(self) -> list[tuple[str, dict]]:
        return []  # chat's tool_choice "required" / a named function (ChatCompletionRequest)

    def _keeps_special_tokens(self) -> bool:
        return False  # chat's auto tool choice: the parser reads the model's special-token markers

    def _thinking_token_budget(self) -> int | None:
        return None  # chat's (ChatCompletionRequest)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """defaults: the server's --generation-config fields, for the ones this request leaves unset."""
        self._unsupported()
        structured = self._structured_outputs()
        kwargs = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      repetition_penalty=self.repetition_penalty)
        try:
            return SamplingParams(
                n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
                skip_special_tokens=self.skip_special_tokens and not self._keeps_special_tokens(),
                structured_outputs=structured, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                thinking_token_budget=self._thinking_token_budget(),
                **{**{k: v for k, v in (defaults or {}).items() if k in kwargs},
                   **{k: v for k, v in kwargs.items() if v is not None}})
        except SamplingParamsError as e:
            raise APIError(str(e), param=e.param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _structural_tag_format(rf: dict) -> dict:
    """vLLM's response_format {"type": "structural_tag", "triggers": [...], "structures": [{"begin", "schema",
    "end"}]}, or its newer {"format": ...} (xgrammar's structural-tag language: structured/struct_tag.py takes
    the triggered tags of JSON schemas, which is what llguidance can express)."""
    if "format" in rf and "structures" not in rf:
        return {"format": rf["format"]}
    if not isinstance(rf.get("triggers"), list) or not isinstance(rf.get("structures"), list):
        raise APIError("response_format structural_tag needs \"triggers\" (a list of strings) and \"structures\" "
                       "(a list of {\"begin\", \"schema\", \"end\"})", param="response_format")
    return {"triggers": rf["triggers"], "structures": rf["structures"]}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra: choices[].prompt_logprobs
    add_special_tokens: bool = True  # text prompts: the tokenizer's BOS (vLLM's)

    def check(self) -> None:
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError("tools are a /v1/chat/completions feature; omit 'tools' and 'tool_choice'",
                           param="tools")
        if self.suffix:
            raise APIError("'suffix' is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("'best_of' other than n is not supported by this server", param="best_of")
        if (self.prompt_logprobs is not None or self.echo and self.logprobs is not None) and self.kv_transfer_params:
            raise APIError("prompt logprobs ('echo' with 'logprobs', or 'prompt_logprobs') are not available "
                           "with kv_transfer_params: a decode instance never computes the prompt",
                           param="prompt_logprobs" if self.prompt_logprobs is not None else "echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError("'prompt' must not be an empty list", param="prompt")
        if self.max_tokens == 0 and not (self.echo and not self.stream):
            raise APIError("'max_tokens' 0 scores the prompt: it needs 'echo': true (and no streaming)",
                           param="max_tokens")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_fields(self) -> dict:
        """The message as chat templates read it (HF's convention for tool calls and results)."""
        out = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# Set by request fields or by the renderer itself, not by chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "chat_template", "tools", "add_generation_prompt", "tokenize",
                             "messages", "documents", "return_dict", "continue_final_message")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra: top-level prompt_logprobs
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's extra: more variables for the chat template
    continue_final_message: bool = False  # the last (assistant) message is left open for the model to continue
    echo: bool = False  # vLLM's: with continue_final_message, the answer starts with that message's text
    add_special_tokens: bool = False  # the chat template writes BOS itself (vLLM's default)
    # OpenAI's (LiteLLM sends it): passed to the chat template as vLLM does, with enable_thinking = not "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: at most this many thinking tokens, then "</think>" is forced (needs --reasoning-parser)
    thinking_token_budget: int | None = Field(None, ge=0)

    def template_kwargs(self) -> dict | None:
        """The chat template's extra variables: chat_template_kwargs, and (vLLM's) reasoning_effort with
        enable_thinking = reasoning_effort != "none" unless chat_template_kwargs sets enable_thinking."""
        taken = [k for k in self.chat_template_kwargs or {} if k in _RESERVED_TEMPLATE_KWARGS]
        if taken:
            raise APIError(f"chat_template_kwargs must not set {taken[0]!r} (a request field sets it)",
                           param="chat_template_kwargs")
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def tool_mode(self, auto_enabled: bool) -> str | None:
        """None (plain text), "named", "required" or "auto"; refuses what cannot be served."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
            return None
        choice = self.tool_choice or "auto"  # OpenAI's default when tools are given
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in [t.function.name for t in self.tools]:
                raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                               "'tools'", param="tool_choice")
            return "named"
        if choice == "auto" and not auto_enabled:
            raise APIError("\"auto\" tool choice needs a server started with --enable-auto-tool-choice and "
                           "--tool-call-parser; or send tool_choice \"required\", \"none\" or a named function",
                           param="tool_choice")
        if choice == "auto" and not self.parallel_tool_calls:
            _log.debug("parallel_tool_calls false is ignored with tool_choice auto: every call the model writes "
                       "is returned (vLLM's)")
        return choice

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def _tool_constraint(self) -> list[tuple[str, dict]]:
        from moeserve.entrypoints.tool_calls import function_parameters, required_schema
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        tools = self.tool_dicts()
        if isinstance(self.tool_choice, NamedToolChoice):
            tool = next(t for t in tools if t["function"]["name"] == self.tool_choice.function.name)
            return [("tool_choice", {"json": function_parameters(tool)})]
        return [("tool_choice", {"json": required_schema(tools, self.parallel_tool_calls)})]

    def _thinking_token_budget(self) -> int | None:
        return self.thinking_token_budget

    def _keeps_special_tokens(self) -> bool:
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def _pattern_error(self, field: str, e: PatternError) -> APIError:
        """A tool's bad schema is named as that tool's field, not as the combined schema's inner path."""
        from moeserve.entrypoints.tool_calls import function_parameters
        if field == "tool_choice":
            for i, tool in enumerate(self.tool_dicts()):
                if isinstance(self.tool_choice, NamedToolChoice) and \
                        tool["function"]["name"] != self.tool_choice.function.name:
                    continue
                try:
                    compile_params(StructuredOutputsParams(json=function_parameters(tool)))
                except PatternError as bad:
                    return APIError(f"'tools[{i}].function.parameters': {bad}", param="tools")
        return super()._pattern_error(field, e)

    def check(self) -> None:
        if self.prompt_logprobs is not None and self.kv_transfer_params:
            raise APIError("'prompt_logprobs' are not available with kv_transfer_params: a decode instance never "
                           "computes the prompt", param="prompt_logprobs")
        if self.add_special_tokens:
            raise APIError("'add_special_tokens' is not supported on /v1/chat/completions: the chat template "
                           "writes the special tokens", param="add_special_tokens")
        if self.echo:
            raise APIError("'echo' is not supported on /v1/chat/completions; use continue_final_message and "
                           "prepend the message yourself", param="echo")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("'continue_final_message' continues the last message: set 'add_generation_prompt' "
                           "to false", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("'continue_final_message' needs the last message to be the assistant's",
                           param="continue_final_message")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only (a chat template writes its own)
    add_generation_prompt: bool = True  # messages only

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of 'prompt' and 'messages'", param="prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
