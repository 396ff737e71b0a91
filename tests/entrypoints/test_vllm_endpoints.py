"""vLLM's other endpoints: /v1/responses through the official openai client's responses.create (plain,
streamed, with a function tool), /v1/messages (Anthropic's shape), /ping, /load, /server_info,
/reset_prefix_cache, /docs, /openapi.json."""
from __future__ import annotations

import json

import httpx
import pytest

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"]}}]


def test_responses_create(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Say hi"}],
                                          max_tokens=6, temperature=0)
    r = client.responses.create(model=model, instructions="Be brief.", input="Say hi", max_output_tokens=6,
                                temperature=0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content  # the same generation
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens


def test_responses_stream_events(client, model):
    with client.responses.stream(model=model, input=[{"role": "user", "content": "Say hi"}], max_output_tokens=6,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    plain = client.responses.create(model=model, input="Say hi", max_output_tokens=6, temperature=0)
    assert final.output_text == plain.output_text


def test_responses_function_tool_round_trip(client, model):
    r = client.responses.create(model=model, input="weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=30,
                                temperature=0)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    # the call and its output go back as input items: the next turn runs
    follow = client.responses.create(model=model, max_output_tokens=4, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    alone = client.responses.create(model=model, max_output_tokens=1, input="weather in Paris?")
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > alone.usage.input_tokens


def test_responses_refuses_stored_state(client, model):
    import openai
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="tool type"):
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])


def test_messages_api(openai_server, model):
    body = {"model": model, "max_tokens": 5, "temperature": 0, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]}
    r = httpx.post(openai_server.url + "/v1/messages", json=body, timeout=60).json()
    assert r["type"] == "message" and r["role"] == "assistant" and r["content"][0]["type"] == "text"
    assert r["stop_reason"] in ("end_turn", "max_tokens") and r["usage"]["output_tokens"] <= 5
    with httpx.stream("POST", openai_server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as s:
        events = [line.split(": ", 1)[1] for line in s.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in events
    bad = httpx.post(openai_server.url + "/v1/messages", json={"model": model, "messages": []}, timeout=30)
    assert bad.status_code == 400


def test_vllm_management_endpoints(openai_server):
    url = openai_server.url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/load").json()["server_load"] >= 0
    info = httpx.get(url + "/server_info").json()
    assert info["max_model_len"] == 256 and info["num_kv_blocks"] > 0
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    assert "swagger" in httpx.get(url + "/docs").text.lower()
    assert "/v1/responses" in httpx.get(url + "/openapi.json").json()["paths"]


def test_reset_prefix_cache_forgets_cached_prompts(client, model, openai_server):
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n" * 4
    for _ in range(2):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(openai_server.url + "/reset_prefix_cache").status_code == 200
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
