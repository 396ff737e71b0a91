"""Clients of vLLM against moeserve (issue 33): reasoning_effort reaches the chat template as vLLM passes it
(from the openai client and from LiteLLM's vLLM and OpenAI providers), the anthropic client's forced tools end
with stop_reason tool_use and its count_tokens works, /openapi.json renders without a FastAPI warning. One real
server with a chat template that prints the variables it gets."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.server import ServerProcess

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "[effort={{ reasoning_effort }} thinking={{ enable_thinking }}"
            "{% if tools %} tools={{ tools | length }}{% endif %}]\nassistant:")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(ckpt_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "echo.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess(ckpt_dir("v3"), "--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
                      "--served-model-name", "m", "--chat-template", str(template), "--enable-auto-tool-choice",
                      "--tool-call-parser", "deepseek_v3", "--reasoning-parser", "deepseek_v3")
    yield s
    s.stop()


def _prompt(server, **extra) -> str:
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1,
                                                                "return_token_ids": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    return httpx.post(server.url + "/detokenize", json={"model": "m", "tokens": ids}, timeout=30).json()["prompt"]


@pytest.mark.parametrize("effort,words", [("high", "[effort=high thinking=True]"),
                                          ("none", "[effort=none thinking=False]"),
                                          (None, "[effort= thinking=]")])
def test_reasoning_effort_reaches_the_chat_template(server, effort, words):
    extra = {} if effort is None else {"reasoning_effort": effort}
    assert words in _prompt(server, **extra)


def test_reasoning_effort_leaves_an_explicit_enable_thinking(server):
    prompt = _prompt(server, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert "[effort=low thinking=False]" in prompt


def test_reasoning_effort_from_the_openai_client(server):
    """The openai client's own reasoning_effort parameter (LiteLLM passes it the same way)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, reasoning_effort="medium")
    assert r.choices[0].finish_reason in ("length", "stop")
    # deepseek_v3's reasoning parser splits thinking when enable_thinking is on (vLLM's rule)
    assert r.choices[0].message.model_extra.get("reasoning_content") is not None


def test_reasoning_effort_bad_value_is_a_400(server):
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1,
                                                                "reasoning_effort": "extreme"}, timeout=30)
    assert r.status_code == 400 and "reasoning_effort" in r.text


@pytest.fixture(scope="module")
def anthropic_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER}]


def test_anthropic_forced_tool_stops_with_tool_use(anthropic_client):
    kw = dict(model="m", max_tokens=100, extra_body={"temperature": 0}, tools=TOOLS, messages=MESSAGES,
              tool_choice={"type": "tool", "name": "get_weather"})
    msg = anthropic_client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input["unit"] in ("c", "f")
    with anthropic_client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == \
        [block.input]


def test_anthropic_plain_answer_still_ends_its_turn(anthropic_client):
    msg = anthropic_client.messages.create(model="m", max_tokens=3, extra_body={"temperature": 0}, messages=MESSAGES)
    assert msg.stop_reason in ("max_tokens", "end_turn") and all(b.type == "text" for b in msg.content)


def test_anthropic_count_tokens(server, anthropic_client):
    system = "Be brief."
    count = anthropic_client.messages.count_tokens(model="m", system=system, messages=MESSAGES)
    # the same prompt as /tokenize renders (system message, user message, generation prompt)
    tok = httpx.post(server.url + "/tokenize", json={"model": "m", "messages": [
        {"role": "system", "content": system}, *MESSAGES]}, timeout=30).json()
    assert count.input_tokens == tok["count"] > 0
    with_tools = anthropic_client.messages.count_tokens(model="m", system=system, messages=MESSAGES, tools=TOOLS)
    assert with_tools.input_tokens > count.input_tokens  # the template prints the tools


@pytest.mark.parametrize("body,status,words", [
    ({"model": "nope", "messages": MESSAGES}, 400, "does not exist"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 5}, 400, "'max_tokens' is not supported"),
    ({"model": "m", "messages": []}, 400, "non-empty"),
])
def test_count_tokens_errors(server, body, status, words):
    r = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert r.status_code == status and words in r.text, r.text


def test_openapi_json_without_warning(server):
    mark = len(server.lines)
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200 and "/v1/messages/count_tokens" in r.json()["paths"]
    assert not any("Warning" in line or "Duplicate Operation ID" in line for line in server.lines[mark:])


def test_anthropic_thinking(server, anthropic_client):
    """thinking disabled: reasoning_effort none for the template (vLLM's mapping); enabled with a budget is
    accepted; the reasoning the parser splits off comes back as thinking blocks, streamed as thinking_delta."""
    msg = anthropic_client.messages.create(model="m", max_tokens=3, messages=MESSAGES,
                                           thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert all(b.type == "text" for b in msg.content)
    count = anthropic_client.messages.count_tokens(model="m", messages=MESSAGES, thinking={"type": "disabled"})
    plain = anthropic_client.messages.count_tokens(model="m", messages=MESSAGES)
    assert count.input_tokens != plain.input_tokens  # the template printed effort=none thinking=False
    kw = dict(model="m", max_tokens=6, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 2048},
              extra_body={"temperature": 0, "chat_template_kwargs": {"thinking": True}})
    msg = anthropic_client.messages.create(**kw)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    with anthropic_client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and final.content[0].type == "thinking"
    assert final.content[0].thinking == msg.content[0].thinking
    r = httpx.post(server.url + "/v1/messages", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                      "thinking": {"type": "enabled", "budget_tokens": 5}}, timeout=30)
    assert r.status_code == 400 and "budget_tokens" in r.text


def test_anthropic_error_body(server, anthropic_client):
    """Errors on /v1/messages in Anthropic's shape, as vLLM serves them; the anthropic client reads them."""
    anthropic = pytest.importorskip("anthropic")
    r = httpx.post(server.url + "/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": MESSAGES},
                   timeout=30)
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error" and "does not exist" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="nope", max_tokens=2, messages=MESSAGES)
    assert "does not exist" in str(e.value)
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "nope", "messages": MESSAGES}, timeout=30)
    assert "type" not in r.json() and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_with_reasoning_effort(server, provider, monkeypatch):
    """LiteLLM (its vLLM provider, and its plain OpenAI one) against moeserve as against vLLM: reasoning_effort
    reaches the chat template and the reasoning comes back split off."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm
    r = litellm.completion(model=f"{provider}/m", api_base=server.base_url, api_key="none", messages=MESSAGES,
                           max_tokens=2, reasoning_effort="medium", timeout=60, num_retries=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.choices[0].message.reasoning_content is not None
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 2


def test_thinking_token_budget_ends_the_reasoning(server):
    """vLLM's thinking_token_budget: after that many thinking tokens the server forces "</think>"; the
    reasoning the parser splits off is those tokens, the answer follows. A request that does not think is not
    bounded (nothing to bound)."""
    end = httpx.post(server.url + "/tokenize", json={"model": "m", "prompt": "</think>", "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    for budget in (0, 3):
        r = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
            "model": "m", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "thinking_token_budget": budget,
            "chat_template_kwargs": {"thinking": True}})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
        at = next(k for k in range(len(ids)) if ids[k:k + len(end)] == end)
        assert at <= budget, (budget, ids, end)
        message = r.json()["choices"][0]["message"]
        assert message["content"]  # the answer after the forced end
        assert (message["reasoning_content"] or "") == httpx.post(server.url + "/detokenize", timeout=30, json={
            "model": "m", "tokens": ids[:at]}).json()["prompt"]
    r = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": "m", "messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": -1})
    assert r.status_code == 400 and "thinking_token_budget" in r.text


def test_anthropic_budget_tokens_is_the_thinking_token_budget():
    """Anthropic's thinking.budget_tokens becomes the chat request's thinking_token_budget (vLLM's mapping)."""
    from moeserve.entrypoints.serving_messages import to_chat_request
    req = to_chat_request({"model": "m", "max_tokens": 8, "messages": MESSAGES,
                           "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert req.thinking_token_budget == 2048
    assert to_chat_request({"model": "m", "max_tokens": 8, "messages": MESSAGES,
                            "thinking": {"type": "adaptive"}}).thinking_token_budget is None
