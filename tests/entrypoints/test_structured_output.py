"""Structured output over HTTP, as OpenAI and vLLM clients ask for it: response_format json_schema /
json_object, vLLM's structured_outputs and guided_* extras, streamed or not; errors name the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "rain": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["city", "rain", "level"]}
MESSAGES = [{"role": "user", "content": "Weather in Paris as JSON"}]


def test_chat_json_schema(client, model):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=120, temperature=0.7, seed=1, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_object_streamed(client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")
    unary = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"})
    assert unary.choices[0].message.content == text  # same greedy text streamed or not


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t, re.ASCII)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "auto"},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_completions_with_vllm_extras(client, model, extra, check):
    r = client.completions.create(model=model, prompt="The answer:", max_tokens=80, temperature=1.0, seed=5, n=2,
                                  extra_body=extra)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json", "minimum (5) is greater"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems' at #: remove it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "if": {"minimum": 0}, "then": {"maximum": 9}}}}}, "response_format",
     "'if' at #: write the cases as alternatives"),
    ({"structured_outputs": {"json": {"type": "string", "not": {"const": "x"}}}}, "structured_outputs",
     "'not' at #: list what is allowed instead"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output constraint"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "Rule 'x' not found"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format", "'/nope' does not exist"),
    # lists where strings belong were unhashable: a TypeError reported as unknown keys
    ({"structured_outputs": {"regex": ["a"]}}, "structured_outputs", "regex must be a string"),
    ({"guided_json": {"properties": {"a": {}}, "required": [["a"]]}}, "guided_json", "Expected string for 'required'"),
    ({"guided_json": {"type": "string", "format": ["date"]}}, "guided_json", "Expected string for 'format'"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, "structured_outputs",
     "takes the keys"),
])
def test_errors_name_the_field(openai_server, model, body, param, words):
    r = httpx.post(f"{openai_server.base_url}/completions", json={"model": model, "prompt": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_allowed_token_ids_apply_with_structured_output(openai_server, model):
    """allowed_token_ids was dropped silently whenever the grammar allowed none of them; both apply."""
    def token(text):
        ids = httpx.post(openai_server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                         timeout=30).json()["tokens"]
        assert len(ids) == 1, (text, ids)
        return ids[0]
    one, two, a = token("1"), token("2"), token("a")
    url = f"{openai_server.base_url}/completions"
    r = httpx.post(url, timeout=60, json={"model": model, "prompt": "x", "max_tokens": 20, "temperature": 0,
                                          "guided_regex": "[0-9]{3,8}", "allowed_token_ids": [one, two],
                                          "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert re.fullmatch("[12]{8}", choice["text"]) and choice["finish_reason"] == "stop", choice
    assert set(choice["token_ids"][:-1]) <= {one, two}
    chat = httpx.post(f"{openai_server.base_url}/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 2, "n": 3,
        "structured_outputs": {"choice": ["12", "21", "3"]}, "allowed_token_ids": [one, two]})
    assert chat.status_code == 200, chat.text
    assert all(c["message"]["content"] in ("12", "21") for c in chat.json()["choices"]), chat.json()
    # none of the allowed tokens can start the pattern: a 400 saying so (it used to ignore allowed_token_ids);
    # streamed too (the first output is the error, before the stream starts)
    for stream in (False, True):
        r = httpx.post(url, timeout=60, json={"model": model, "prompt": "x", "max_tokens": 5, "stream": stream,
                                              "response_format": {"type": "json_object"}, "allowed_token_ids": [a]})
        assert r.status_code == 400, r.text
        assert "structured output together allow no token" in r.json()["error"]["message"], r.text


# vLLM's response_format structural_tag: free text; each trigger ("e", frequent in this random model's output)
# starts a section that must be the begin, JSON of the schema, then the end
TAG = {"type": "structural_tag", "triggers": ["e"], "structures": [{"begin": "e=", "end": ";", "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 5}}, "required": ["n"]}}]}


# the same as vLLM's newer shape (xgrammar's structural-tag language, the part llguidance can express)
TAG_FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["e"], "tags": [
    {"type": "tag", "begin": "e=", "end": ";", "content": {"type": "json_schema",
                                                          "json_schema": TAG["structures"][0]["schema"]}}]}}


@pytest.mark.parametrize("rf", [TAG, TAG_FORMAT], ids=["triggers-structures", "format"])
def test_chat_response_format_structural_tag(openai_server, model, rf):
    r = httpx.post(f"{openai_server.base_url}/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 3, "n": 4,
        "response_format": rf})
    assert r.status_code == 200, r.text
    sections = 0
    for c in r.json()["choices"]:
        text = c["message"]["content"]
        if c["finish_reason"] == "length":  # cut inside a section: drop the unfinished one
            text = text[:text.rfind("e")] if text.count("e") > text.count(";") else text
        bodies = re.findall(r"e=(.*?);", text, re.S)
        assert "e" not in re.sub(r"e=.*?;", "", text, flags=re.S), text  # every "e" began a section
        for body in bodies:
            assert 2 <= json.loads(body)["n"] <= 5, text
        sections += len(bodies)
    assert sections, r.json()  # the trigger came up


@pytest.mark.parametrize("rf,words", [
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}},
     "structural_tag format type 'sequence': only \"format\": {\"type\": \"triggered_tags\""),
    ({"type": "structural_tag", "structures": []}, "needs \"triggers\""),
    ({**TAG, "triggers": ["<g"]}, "starts with none of the triggers"),
    ({"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<f>", "end": "</f>", "schema": {
        "type": "array", "uniqueItems": True}}]}, "'uniqueItems' at structures[0].schema #"),
    ({"type": "xml"}, "use \"text\", \"json_object\", \"json_schema\" or \"structural_tag\""),
])
def test_chat_response_format_structural_tag_errors(openai_server, model, rf, words):
    r = httpx.post(f"{openai_server.base_url}/chat/completions", timeout=30, json={
        "model": model, "messages": MESSAGES, "max_tokens": 5, "response_format": rf})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and words in err["message"], err
