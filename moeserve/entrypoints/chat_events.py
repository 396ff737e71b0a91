"""What a streamed chat answer is made of, as typed events: the chat handler (serving_chat.py) turns engine
deltas into these once (reasoning split, tool calls parsed), and each API writes them in its own wire format
(chat completion chunks, Responses events, Anthropic Messages events) without re-reading another API's JSON."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChoiceStarted:
    """A choice's first event. prompt_logprobs: the response's prompt logprobs field ({} unless asked), on the
    first choice to start only."""
    index: int
    role: str
    prompt_logprobs: dict = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None  # return_token_ids: on every choice's first event, as vLLM sends it


@dataclass
class ChoiceDelta:
    """One engine step of one choice: the text it added, split into reasoning and content; tool calls when the
    choice ends with them (OpenAI's tool_calls delta entries); logprobs (None unless asked); the finish."""
    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] | None = None
    logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ids this step added


@dataclass
class Usage:
    """The request's token counts (OpenAI's usage object), after every choice finished."""
    usage: dict


@dataclass
class Failed:
    """The stream ends with this error (the engine failed the request, or the server is shutting down)."""
    error: Exception


ChatEvent = ChoiceStarted | ChoiceDelta | Usage | Failed
