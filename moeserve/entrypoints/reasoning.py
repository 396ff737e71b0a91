"""Reasoning output for /v1/chat/completions (vLLM's --reasoning-parser): a thinking model's text up to
`</think>` is `reasoning_content`, the rest is `content`.

- deepseek_r1: R1's chat template ends the prompt inside `<think>`, so everything up to `</think>` is
  reasoning (a leading `<think>` is dropped). An output that never closes it is all reasoning, as in vLLM.
- deepseek_v3: V3.1's hybrid template thinks only when the request sends
  `chat_template_kwargs: {"thinking": true}`; then as deepseek_r1, otherwise plain content.
"""
from __future__ import annotations

from moeserve.markers import THINK_END, THINK_START, partial_marker_len

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3")


def thinks(parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """Whether this request's output starts with reasoning."""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":  # vLLM's: thinking, or enable_thinking (which reasoning_effort sets)
        kwargs = chat_template_kwargs or {}
        return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    return False


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output."""
    if text.startswith(THINK_START):
        text = text[len(THINK_START):]
    reasoning, end, content = text.partition(THINK_END)
    if not end:
        return text, None
    return reasoning, content or None


class StreamedReasoning:
    """Splits a stream of text deltas at `</think>`; a tail that could be the marker's start is held back
    (so neither side ever shows part of the marker) until the next delta or finish()."""

    def __init__(self) -> None:
        self.buffer, self.done, self.started = "", False, False

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        if self.done:
            return "", delta
        self.buffer += delta
        if not self.started:  # drop a leading <think> (or wait until it cannot be one)
            if THINK_START.startswith(self.buffer):
                return "", ""
            if self.buffer.startswith(THINK_START):
                self.buffer = self.buffer[len(THINK_START):]
            self.started = True
        cut = self.buffer.find(THINK_END)
        if cut >= 0:
            self.done = True
            reasoning, content = self.buffer[:cut], self.buffer[cut + len(THINK_END):]
            self.buffer = ""
            return reasoning, content
        keep = partial_marker_len(self.buffer, THINK_END)
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out, ""

    def finish(self) -> str:
        """The held-back reasoning tail (the stream ended inside the thinking)."""
        if not self.started and self.buffer.startswith(THINK_START):  # the output was just "<think>"
            self.buffer = self.buffer[len(THINK_START):]
        out, self.buffer = self.buffer, ""
        return out
