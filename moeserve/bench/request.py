"""One streamed request against an OpenAI-compatible server, timed as `vllm bench serve` times it.

TTFT: send -> first chunk carrying text. ITL: gaps between later text chunks. Latency: send -> last text
chunk. Output tokens: the server's usage (stream_options.include_usage) when it reports one, else the
tokenizer's count of the generated text.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    start: float = 0.0
    queue_time: float = 0.0  # seconds it waited for a --max-concurrency slot before it was sent (vLLM's)


def _payload(endpoint: str, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, **extra}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(data: dict) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: str, prompt_len: int, max_tokens: int,
               extra: dict, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    st = res.start = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", url, json=_payload(url, model, prompt, max_tokens, extra),
                                 headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                now = time.perf_counter()
                text = _chunk_text(obj)
                if text:
                    if res.ttft == 0.0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += text
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.prompt_len = usage.get("prompt_tokens") or prompt_len
        res.latency = last - st
        res.success = res.ttft > 0.0
        if not res.success:
            res.error = "the response carried no text"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
