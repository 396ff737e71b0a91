"""Tool calling on /v1/chat/completions: a named function and "required" guided to the tools' schemas,
"auto" with DeepSeek-V3's markers parsed (the parser alone, and end to end with a regex that makes the
tiny model write the markers as text), streamed deltas adding up to the unary answer; and the reasoning
parser's split at </think>, which shares the server (--reasoning-parser deepseek_v3)."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from moeserve.entrypoints.tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, StreamedContent,
                                             parse_deepseek_v3, parse_required)
from moeserve.entrypoints.reasoning import StreamedReasoning, split_reasoning
from tests.entrypoints.server import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def test_deepseek_v3_parser():
    text = "Let me check." + CALLS_BEGIN + v3_call("get_weather", '{"city": "Paris"}') + \
        f"{CALL_BEGIN}ping{SEP}{{}}{CALL_END}" + CALLS_END  # a V3 call, then a V3.1-style one
    content, calls = parse_deepseek_v3(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert parse_deepseek_v3("no calls here") == ("no calls here", [])
    cut = CALLS_BEGIN + v3_call("a", "{}") + CALL_BEGIN + "function" + SEP + "b\n```json\n{"
    assert [c.name for c in parse_deepseek_v3(cut)[1]] == ["a"]  # the cut-off call is dropped


@pytest.mark.parametrize("split", [1, 3, 7])
def test_streamed_content_stops_at_the_marker_even_split_across_deltas(split):
    text = "Sure <thing>" + CALLS_BEGIN + v3_call("ping", "{}") + CALLS_END
    s, sent = StreamedContent(), ""
    for i in range(0, len(text), split):
        sent += s.push(text[i:i + split])
    rest, calls = s.finish()
    assert sent + rest == "Sure <thing>" and [c.name for c in calls] == ["ping"]
    plain = StreamedContent()
    assert plain.push("a <｜to") == "a " and plain.finish() == ("<｜to", [])  # held back, then released


def test_named_call_needs_text():
    # A thinking request that ends (EOS) before </think> has no text after it: no call with arguments "".
    from moeserve.entrypoints.openai_protocol import ChatCompletionRequest
    from moeserve.entrypoints.serving_chat import ChatServing
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "ping"}}})
    serving = ChatServing.__new__(ChatServing)
    assert serving._message(req, "named", "", "stop") == ({"role": "assistant", "content": None}, "stop")
    msg, finish = serving._message(req, "named", "{}", "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"} and finish == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}],
                         ids=["required", "named"])
def test_tool_schemas_with_defs_and_bad_ones(choice):
    from moeserve.entrypoints.errors import APIError
    from moeserve.entrypoints.openai_protocol import ChatCompletionRequest
    from moeserve.structured.params import compile_params

    def params(parameters):
        tools = [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": parameters}}]
        return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": choice}) \
            .sampling_params(10, None)
    # pydantic writes $defs with "#/$defs/..." refs; "required" nests the schema in its array of calls
    defs = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}}, "properties": {"u": {"$ref": "#/$defs/Unit"}},
            "required": ["u"]}
    dfa = compile_params(params(defs).structured_outputs)
    text = '[{"name":"f","parameters":{"u":"c"}}]' if choice == "required" else '{"u":"c"}'
    assert dfa.fullmatch(text.encode()) and not dfa.fullmatch(text.replace('"c"', '"k"').encode())
    with pytest.raises(APIError) as e:  # a bad schema is named as the tool's field, not the combined schema's
        params({"type": "object", "properties": {"a": {"type": "nope"}}})
    assert e.value.param == "tools" and e.value.message.startswith("'tools[1].function.parameters': ") \
        and "nope" in e.value.message


def test_parse_required():
    calls = parse_required('[{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "é"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("ping", "{}"), ("get_weather", '{"city": "é"}')]
    assert parse_required('[{"name": "pi') is None


@pytest.fixture(scope="module")
def auto_server(ckpt_dir):
    server = ServerProcess(ckpt_dir("v3"), "--max-model-len", "512", "--dtype", "float32",
                           "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3",
                           "--reasoning-parser", "deepseek_v3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(auto_server):
    # A server of its own: 512 tokens of context (the tools' JSON is in the prompt), auto tool choice on.
    return openai.OpenAI(base_url=auto_server.base_url, api_key="none", max_retries=0, timeout=120)


def _streamed(client, **kw):
    """(content, {index: (name, arguments)}, finish_reason) assembled from the deltas, as clients do."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_named_function(client, model):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert _streamed(client, **kw) == ("", {0: ("get_weather", call.function.arguments)}, "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, model, parallel):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=0.8, seed=4,
              tool_choice="required", parallel_tool_calls=parallel)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [calls[i] for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                 for c in choice.message.tool_calls]


def test_tool_turns_render(client, model):
    messages = MESSAGES + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "pong"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 20


def test_auto_needs_the_server_flags(openai_server):
    r = httpx.post(f"{openai_server.base_url}/chat/completions", json={"messages": MESSAGES, "tools": TOOLS},
                   timeout=30)  # "auto" is the default with tools
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "tools", ""),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "one structured-output"),
])
def test_chat_tool_errors(auto_server, model, body, param, words):
    r = httpx.post(f"{auto_server.base_url}/chat/completions",
                   json={"model": model, "messages": MESSAGES, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_completions_refuse_tools(auto_server, model):
    r = httpx.post(f"{auto_server.base_url}/completions", json={"model": model, "prompt": "x", "tools": TOOLS},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_auto_parses_deepseek_calls(auto_server, client, model):
    # The tiny model has no marker tokens; its byte-level vocabulary spells them as text, and the regex
    # makes it write "text, then one V3 call": the parser's path through the server, unary and streamed.
    pattern = (r"[a-z]{1,6}" + re.escape(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "ping\n```json\n")
               + r"\{\}" + re.escape("\n```" + CALL_END + CALLS_END))
    c = client
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"guided_regex": pattern})
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert re.fullmatch("[a-z]{1,6}", choice.message.content)
    assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [("ping", "{}")]
    assert _streamed(c, **kw) == (choice.message.content, {0: ("ping", "{}")}, "tool_calls")
    plain = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


# ---- reasoning (--reasoning-parser); the module's server runs deepseek_v3: thinking on request ----

@pytest.mark.parametrize("text,want", [
    ("plan it</think>The answer", ("plan it", "The answer")),
    ("<think>plan</think>", ("plan", None)),
    ("still thinking", ("still thinking", None)),  # never closed: all reasoning, as vLLM's deepseek_r1
])
def test_split_reasoning(text, want):
    assert split_reasoning(text) == want


@pytest.mark.parametrize("split", [1, 2, 5])
@pytest.mark.parametrize("text", ["<think>a < b, so</think>x</think>y", "no end </thi", "</think>", "<thin",
                                  "<think>"])  # the output ended right after <think> (max_tokens 1)
def test_streamed_reasoning_adds_up_to_the_split(text, split):
    s, reasoning, content = StreamedReasoning(), "", ""
    for i in range(0, len(text), split):
        r, c = s.push(text[i:i + split])
        assert "</think>" not in r + c
        reasoning, content = reasoning + r, content + c
    reasoning += s.finish()
    want_r, want_c = split_reasoning(text)
    assert (reasoning, content) == (want_r or "", want_c or "")


def test_thinking_request_returns_reasoning_content(client, model):
    kw = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    assert msg["content"] is None and msg["reasoning_content"]  # the tiny model never writes </think>
    reasoning = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            assert not ch.delta.content
    assert reasoning == msg["reasoning_content"]
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == msg["reasoning_content"]  # same text, not split without thinking
    assert "reasoning_content" not in plain.choices[0].message.model_dump()


def test_reserved_template_kwargs_are_refused(auto_server, model):
    r = httpx.post(f"{auto_server.base_url}/chat/completions",
                   json={"model": model, "messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
