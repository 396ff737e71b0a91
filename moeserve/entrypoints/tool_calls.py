"""Tool calling for /v1/chat/completions, as vLLM does it.

- `tool_choice` a named function: the output is guided to that function's `parameters` schema and becomes
  the call's arguments.
- `tool_choice: "required"`: the output is guided to a JSON array of {"name", "parameters"} objects, one of
  the tools each (one item when `parallel_tool_calls` is false), parsed into calls.
- `tool_choice: "auto"` (needs `--enable-auto-tool-choice --tool-call-parser deepseek_v3`; vLLM's
  deepseek_v31 and deepseek_v32 name the same parser): the model decides; DeepSeek's tool-call markers in
  its output (V3/R1, V3.1, or V3.2's DSML `function_calls` block) are parsed into calls, text before them
  stays content. Special tokens are kept in the text for this (the markers are special tokens).
- `"none"` (the default without tools): plain text. Tools are passed to the chat template in every mode.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from moeserve.markers import partial_marker_len

TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31", "deepseek_v32")  # one parser reads all three formats

# DeepSeek-V3's markers (U+FF5C fullwidth bar, U+2581 lower block), as its tokenizer and template write them.
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# V3 / R1: <call begin>function<sep>NAME\n```json\nARGS\n```<call end>; V3.1: <call begin>NAME<sep>ARGS<call end>
_V3_CALL = re.compile(r"function" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n(?P<args>.*)\n```\s*$", re.S)
_V31_CALL = re.compile(r"(?P<name>[^\n]*?)" + re.escape(SEP) + r"(?P<args>.*)$", re.S)
# V3.2 (DSML): <|DSML|function_calls><|DSML|invoke name="f"><|DSML|parameter name="p" string="true">v
# </|DSML|parameter>...</|DSML|invoke></|DSML|function_calls>; string="false" values are JSON.
_DSML = "｜DSML｜"
DSML_BEGIN, DSML_END = f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"
_DSML_INVOKE = re.compile(rf'<{_DSML}invoke name="(?P<name>[^"]*)">(?P<body>.*?)</{_DSML}invoke>', re.S)
_DSML_PARAM = re.compile(rf'<{_DSML}parameter name="(?P<name>[^"]*)" string="(?P<string>true|false)">'
                         rf'(?P<value>.*?)</{_DSML}parameter>', re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def function_parameters(tool: dict) -> dict:
    """A tool's parameters schema; a function without one takes any JSON object."""
    return tool["function"].get("parameters") or {"type": "object"}


def _rebase_refs(schema, base: str):
    """The schema with its local $refs ("#/$defs/X", "#") pointing below `base`, where it now sits."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in ("const", "enum", "default", "examples"):  # values, not schemas
            out[k] = v
        else:
            out[k] = _rebase_refs(v, base)
    return out


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """"required": a non-empty array of calls, each naming one tool with arguments of its schema."""
    # Each tool's parameters move below the array's root: their local $refs ($defs, as pydantic writes
    # them) must point there.
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _rebase_refs(
                 function_parameters(t), f"#/items/anyOf/{i}/properties/parameters")},
              "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ToolCall] | None:
    """The "required" mode's JSON array -> calls; None when the output is not complete JSON (cut off)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def _parse_dsml(text: str, start: int) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for m in _DSML_INVOKE.finditer(text.split(DSML_END, 1)[0], start):
        args = {}
        for p in _DSML_PARAM.finditer(m.group("body")):
            value = p.group("value")
            if p.group("string") == "false":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass  # the model wrote a bare word: keep it as text
            args[p.group("name")] = value
        calls.append(ToolCall(m.group("name"), json.dumps(args, ensure_ascii=False)))
    return text[:start] or None, calls


def first_marker(text: str) -> int:
    """Where the first tool-call block (any DeepSeek format) starts; -1 when there is none."""
    found = [i for i in (text.find(CALLS_BEGIN), text.find(DSML_BEGIN)) if i >= 0]
    return min(found) if found else -1


def parse_deepseek_v3(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls or None, calls) from DeepSeek's output; no markers: (text, [])."""
    start = first_marker(text)
    if start < 0:
        return text, []
    if text.startswith(DSML_BEGIN, start):
        return _parse_dsml(text, start)
    content = text[:start] or None
    body = text[start + len(CALLS_BEGIN):]
    body = body.split(CALLS_END, 1)[0]
    calls = []
    for chunk in body.split(CALL_BEGIN)[1:]:
        if CALL_END not in chunk:
            continue  # cut off inside a call (max_tokens): not a call
        inner = chunk.split(CALL_END, 1)[0]
        m = _V3_CALL.match(inner) or _V31_CALL.match(inner)
        if m:
            calls.append(ToolCall(m.group("name").strip(), m.group("args").strip()))
    return content, calls


class StreamedContent:
    """Auto mode, streamed: text deltas pass until the calls' marker (or its start) appears; the rest is
    held back and parsed when the choice finishes."""

    def __init__(self) -> None:
        self.text, self.sent = "", 0

    def push(self, delta: str) -> str:
        self.text += delta
        cut = first_marker(self.text)
        if cut < 0:  # hold back a tail that could be a marker's beginning
            cut = len(self.text) - max(partial_marker_len(self.text, CALLS_BEGIN),
                                       partial_marker_len(self.text, DSML_BEGIN))
        out = self.text[self.sent:max(cut, self.sent)]
        self.sent = max(cut, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls)."""
        content, calls = parse_deepseek_v3(self.text)
        content = content or ""
        return content[self.sent:], calls
