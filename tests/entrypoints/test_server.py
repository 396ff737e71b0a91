"""The OpenAI server as users use it: a real `moeserve serve` (2 API servers) and the official openai client."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from moeserve import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32")


def offline(llm, prompts, **kw):
    outs = llm.generate(prompts, SamplingParams(temperature=0, **kw))
    return [o.outputs[0] for o in outs]


def test_models_health_version(openai_server, client, ckpt_dir):
    models = client.models.list().data
    # vLLM's default name: the model argument as given; the folder's name is accepted too
    assert [m.id for m in models] == [ckpt_dir("v3"), ckpt_dir("v3").rstrip("/").split("/")[-1]]
    assert httpx.get(openai_server.url + "/health").status_code == 200
    assert "version" in httpx.get(openai_server.url + "/version").json()


def test_completion_greedy_equals_offline(client, model, llm):
    want = offline(llm, PROMPTS, max_tokens=12)
    got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    tok = llm.get_tokenizer()
    assert got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    # Token-id prompt and streaming give the same text.
    ids = tok.encode(PROMPTS[0])
    one = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert one.choices[0].text == want[0].text
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].text
    assert chunks[-1].usage.completion_tokens == len(want[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[0].finish_reason


def test_completion_logprobs_echo_n_seed_stop(client, model, llm):
    r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) >= 3 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    echo = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[1] + r.choices[0].text
    kw = dict(model=model, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    full = offline(llm, [PROMPTS[0]], max_tokens=16)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    s = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == full[:full.find(stop)]


def test_chat_stream_and_not(client, model, llm):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 10
    assert len(r.choices[0].logprobs.content) == 10
    assert all(len(e.top_logprobs) == 2 for e in r.choices[0].logprobs.content)
    # Same as the offline engine on the prompt the default template renders.
    tok = llm.get_tokenizer()
    rendered = "<|begin|>system: be brief\nuser: hello\nassistant:"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    want = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=10))
    assert text == want[0].outputs[0].text
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + 10


def test_sse_ends_with_done(openai_server, model):
    body = {"model": model, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", openai_server.base_url + "/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_64_concurrent_streaming_clients(openai_server, model, llm):
    prompts = [f"{PROMPTS[i % 4]} # {i}" for i in range(64)]
    want = [w.text for w in offline(llm, prompts, max_tokens=8)]
    aclient = openai.AsyncOpenAI(base_url=openai_server.base_url, api_key="none", max_retries=0, timeout=300)

    async def one(p):
        stream = await aclient.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == want


def test_disconnect_aborts_and_frees_blocks(openai_server, model):
    body = {"model": model, "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
    aborted = openai_server.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", openai_server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert openai_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v > 0) > 0
    # Closing the response hangs up; the request must leave the engine and give back its blocks.
    assert openai_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert openai_server.wait_metric("vllm:num_requests_running", lambda v: v == 0) == 0
    assert openai_server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_metrics_count_tokens_exactly(openai_server, client, model):
    before = {m: openai_server.metric(m) for m in ("vllm:generation_tokens_total",
                                                   "vllm:prompt_tokens_total",
                                                   "vllm:e2e_request_latency_seconds_count")}
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=5, temperature=0)
    after = {m: openai_server.metric(m) for m in before}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        r.usage.completion_tokens
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["vllm:e2e_request_latency_seconds_count"] - \
        before["vllm:e2e_request_latency_seconds_count"] == len(PROMPTS)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):
        openai_server.metric(name)  # present


def test_penalties_equal_offline(client, model, llm):
    kw = dict(presence_penalty=0.8, frequency_penalty=0.3)
    want = offline(llm, PROMPTS[:2], max_tokens=12, repetition_penalty=1.3, **kw)
    got = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                    extra_body={"repetition_penalty": 1.3}, **kw)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert want[0].token_ids != offline(llm, PROMPTS[:1], max_tokens=12)[0].token_ids


def test_echo_with_logprobs_scores_the_prompt(client, model, llm):
    """OpenAI's legacy scoring (what lm-eval's loglikelihood sends): echo + logprobs lead with the prompt's
    tokens, the first without a logprob; the values are the offline engine's prompt_logprobs."""
    prompt = PROMPTS[2]
    ids = llm.get_tokenizer().encode(prompt)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, t in enumerate(ids[1:], start=1):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][t], abs=1e-4)
        assert len(lp.top_logprobs[i]) >= 2
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed[: len(ids) + 1] == lp.tokens
    # vLLM's prompt_logprobs extra: per prompt token {token id: {logprob, decoded_token}}
    body = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 1}).model_dump()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(want.prompt_logprobs[1][ids[1]], abs=1e-4)


def test_text_offset_counts_characters_across_split_multibyte_characters(client, model, llm):
    """text_offset used to add up per-token strings, in which each byte of a character split over tokens is a
    U+FFFD of its own: every token after "€" (three one-byte tokens) was placed two characters too far."""
    from moeserve.entrypoints.serving_completion import token_offsets
    tok = llm.get_tokenizer()
    prompt = "a€b naïve"
    assert [tok.decode([t]) for t in tok.encode(prompt)] == ["a", *"\ufffd" * 3, "b", " n", "a", *"\ufffd" * 2, "ve"]
    for stream in (False, True):
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                           echo=True, stream=stream)
        offsets = [o for c in ([chunks] if not stream else chunks) for o in c.choices[0].logprobs.text_offset]
        assert offsets[:11] == [0, 1, 1, 1, 2, 3, 5, 6, 6, 7, 9], stream  # the prompt's tokens, then the answer's
    # Generated multibyte characters: sampling among the two byte tokens of "é" (seeded, so the offline
    # engine gives the same tokens) makes whole and broken characters; offsets are the text's.
    bias = {t: 100.0 for t in tok.encode("é", add_special_tokens=False)}
    kw = dict(temperature=1.0, seed=3, max_tokens=12, logit_bias=bias, logprobs=0)
    want = llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]
    assert "é" in want.text
    expected, end = token_offsets(tok.decode, want.token_ids)
    drifted = [sum(len(tok.decode([t])) for t in want.token_ids[:i]) for i in range(len(want.token_ids))]
    assert end == len(want.text) and expected != drifted
    kw["logit_bias"] = {str(t): b for t, b in bias.items()}
    r = client.completions.create(model=model, prompt=prompt, **kw)
    assert r.choices[0].text == want.text and r.choices[0].logprobs.text_offset == expected
    chunks = client.completions.create(model=model, prompt=prompt, stream=True, **kw)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == expected


def same_prompt_logprobs(a: list, b: list) -> bool:
    """Equal prompt_logprobs lists: the same tokens and decoded tokens, logprobs within float noise."""
    return len(a) == len(b) and all(
        x == y if x is None or y is None else
        x.keys() == y.keys() and all(x[k]["decoded_token"] == y[k]["decoded_token"]
                                     and abs(x[k]["logprob"] - y[k]["logprob"]) < 1e-4 for k in x)
        for x, y in zip(a, b))


def test_chat_prompt_logprobs(openai_server, client, model, llm):
    """vLLM's prompt_logprobs extra on chat: a top-level list (every choice shares the prompt) in the shape
    completions use per choice; it used to be ignored. Streamed, the first chunk carries it."""
    msgs = [{"role": "user", "content": "hello there"}]
    ids = llm.get_tokenizer().encode("<|begin|>user: hello there\nassistant:", add_special_tokens=False)
    want = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1,
                                                                               prompt_logprobs=2))[0]
    body = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0, n=2,
                                          extra_body={"prompt_logprobs": 2}).model_dump()
    plp = body["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) == body["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in body["choices"][0]
    tok = llm.get_tokenizer()
    for i, t in enumerate(ids[1:], start=1):
        assert plp[i][str(t)]["logprob"] == pytest.approx(want.prompt_logprobs[i][t], abs=1e-4)
        assert plp[i][str(t)]["decoded_token"] == tok.decode([t])
        assert 2 <= len(plp[i]) <= 3  # the top 2, and the prompt's token when it is not among them
    completion = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 2}).model_dump()
    assert same_prompt_logprobs(completion["choices"][0]["prompt_logprobs"], plp)  # the same shape and values
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=1).model_dump()
    assert "prompt_logprobs" not in plain
    chunks = [c.model_dump() for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=3, temperature=0, stream=True, extra_body={"prompt_logprobs": 2})]
    assert same_prompt_logprobs(chunks[0]["prompt_logprobs"], plp)
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    url = openai_server.base_url + "/chat/completions"
    for extra, words in [({"prompt_logprobs": 99}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                         ({"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}}, "decode instance")]:
        r = httpx.post(url, json={"model": model, "messages": msgs, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert words in r.json()["error"]["message"], r.text


def test_tokenize_and_detokenize(openai_server, model, llm):
    tok = llm.get_tokenizer()
    r = httpx.post(openai_server.url + "/tokenize", json={"model": model, "prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(PROMPTS[0])
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 256
    messages = [{"role": "user", "content": "hello there"}]
    chat = httpx.post(openai_server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    # the chat answer's prompt_tokens is what /tokenize says the template renders
    client = openai.OpenAI(base_url=openai_server.base_url, api_key="none")
    usage = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    back = httpx.post(openai_server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()
    assert back["prompt"] == tok.decode(tok.encode(PROMPTS[0]))
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "nope"}, "model")]:
        bad = httpx.post(openai_server.url + path, json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_prefix_cache_reported_in_usage_and_metrics(openai_server, client, model):
    """A repeated long prompt reuses its cached blocks: usage says how many prompt tokens, /metrics counts
    them (vLLM's prefix_cache_queries / _hits), and the answer is the same."""
    prompt = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n" * 3
    hits = "vllm:prefix_cache_hits_total"
    before = openai_server.metric(hits)
    first = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks, never the last token
    assert openai_server.wait_metric(hits, lambda v: v >= before + cached) >= before + cached
    assert openai_server.metric("vllm:prefix_cache_queries_total") >= again.usage.prompt_tokens


BAD = [
    ("completions", b"{not json", 400),
    ("completions", b"[1, 2]", 400),
    ("completions", {"max_tokens": 4}, 400),  # no prompt
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("completions", {"prompt": 5}, 400),
    ("completions", {"prompt": [1, "a"]}, 400),
    ("completions", {"prompt": "x", "temperature": -1}, 400),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400),
    ("completions", {"prompt": "x", "top_k": -5}, 400),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, 400),
    ("completions", {"prompt": "x", "prompt_logprobs": 99}, 400),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}},
     400),
    ("completions", {"prompt": "x", "frequency_penalty": "lots"}, 400),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400),
    ("completions", {"prompt": "x", "min_p": 2}, 400),
    ("completions", {"prompt": "x", "n": 0}, 400),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("completions", {"prompt": "x", "logprobs": 99}, 400),
    ("completions", {"prompt": "x", "seed": 2 ** 70}, 400),
    ("completions", {"prompt": "x", "stop": [""]}, 400),
    ("completions", {"prompt": [10 ** 6]}, 400),  # token id outside the vocabulary
    ("completions", {"prompt": []}, 400),
    ("completions", {"prompt": ""}, 400),
    ("completions", {"prompt": "x", "model": "no-such-model"}, 400),
    ("completions", {"prompt": "x " * 300}, 400),  # over the 256-token context
    ("completions", {"prompt": "x", "max_tokens": 10 ** 6}, 400),
    ("completions", {"prompt": "x", "stream": "yes"}, 400),
    ("completions", {"prompt": "x", "top_k": 10 ** 23}, 400),  # does not fit 64 bits
    ("completions", {"prompt": "x", "top_k": 10 ** 23, "stream": True}, 400),
    ("completions", {"prompt": "x", "min_tokens": 2 ** 64}, 400),
    ("completions", {"prompt": "x", "stop_token_ids": [2 ** 64]}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 9}, 400),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400),
    ("completions", {"prompt": "x", "logit_bias": {"1": 500}}, 400),
    ("completions", {"prompt": "x", "logit_bias": {str(10 ** 6): 1}}, 400),
    ("completions", {"prompt": "x", "logit_bias": {str(10 ** 6): 1}, "stream": True}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "structural_tag"}}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("completions", {"prompt": "x", "guided_regex": "(a"}, 400),
    ("completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400),
    ("completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= 'a'"}}, 400),
    ("completions", {"prompt": "x", "structured_outputs": {"jsonn": {}}}, 400),
    ("completions", {"prompt": "x", "guided_json": {"type": "integer", "minimum": 5, "maximum": 1},
                     "stream": True}, 400),
    ("completions", {"prompt": "x", "guided_choice": "a"}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("chat/completions", {"messages": []}, 400),
    ("chat/completions", {"messages": "hi"}, 400),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 50}, 400),
    ("nope", {"prompt": "x"}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_4xx_and_server_keeps_serving(openai_server, client, model, path, body, status):
    url = f"{openai_server.base_url}/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body if "model" in body else {"model": model, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_error_names_the_field(openai_server, model):
    url = f"{openai_server.base_url}/completions"
    for body, param in [({"stream": "yes"}, "stream"), ({"stream_options": "x", "stream": True}, "stream_options"),
                        ({"top_p": 1.5}, "top_p"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                        ({"logit_bias": {str(10 ** 6): 1}}, "logit_bias"), ({"temperature": -1}, "temperature")]:
        err = httpx.post(url, json={"model": model, "prompt": "x", **body}, timeout=30).json()["error"]
        assert err["param"] == param and param in err["message"], err
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}
    err = httpx.post(f"{openai_server.base_url}/chat/completions", json=chat, timeout=30).json()["error"]
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"], err


def test_null_means_default_and_odd_values_are_served(openai_server, client, model, llm):
    url = f"{openai_server.base_url}/completions"
    want = offline(llm, [PROMPTS[0]], max_tokens=4)[0].text
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "n": None, "stream": None,
            "echo": None, "ignore_eos": None, "logprobs": None, "stop": None, "logit_bias": None}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None,
            "response_format": {"type": "text"}, "tool_choice": "none"}
    assert httpx.post(f"{openai_server.base_url}/chat/completions", json=chat, timeout=60).status_code == 200
    # A top_p that is 0 in float32 samples the best token instead of killing the engine core.
    tiny = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, top_p=1e-46)
    assert tiny.choices[0].text == want
    # n seeds next to the 64-bit limit wrap around instead of failing.
    many = client.completions.create(model=model, prompt="x", max_tokens=2, n=3, seed=2 ** 63 - 2)
    assert len(many.choices) == 3
    assert httpx.get(openai_server.url + "/health").status_code == 200


def test_logit_bias_is_applied(client, model, llm):
    g = offline(llm, [PROMPTS[1]], max_tokens=3)[0].token_ids
    target = (g[0] + 11) % 100 + 3
    r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                  logit_bias={str(target): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [llm.get_tokenizer().decode([target])] * 3


def test_streamed_stop_string_over_token_boundaries_equals_offline(client, model, llm):
    full = offline(llm, [PROMPTS[2]], max_tokens=16)[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(full.token_ids[:i + 1]) for i in range(len(full.token_ids))]
    # A stop string that starts one character before a token boundary and runs into the next token.
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = full.text[len(pieces[k]) - 1: len(pieces[k]) + 1]
    want = offline(llm, [PROMPTS[2]], max_tokens=16, stop=[stop])[0].text
    assert want == full.text[: full.text.find(stop)]
    got = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert got.choices[0].text == want
    chunks = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                       stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
