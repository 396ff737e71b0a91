"""What a request's output must look like (vLLM's StructuredOutputsParams), and its compiled form.

Exactly one of: `json` (a JSON Schema, dict or JSON text), `regex`, `choice` (a list of exact strings),
`json_object` (any JSON object, OpenAI's response_format json_object), `grammar` (Lark or GBNF / EBNF),
`structural_tag` (vLLM's {triggers, structures}). The spec is checked as an llguidance grammar
(structured/guidance.py), which needs no tokenizer, so the API server compiles to validate (a bad spec is a
400 there) and sends the result with the request (structured_grammar); engine processes never compile.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING

from moeserve.structured.errors import PatternError

if TYPE_CHECKING:
    from moeserve.structured.guidance import GuidanceGrammar

# The hand-written engine ("builtin") was removed (issue 40): a server started with it set must not quietly run
# another engine than the one asked for.
if os.environ.get("MOESERVE_STRUCTURED_BACKEND", "llguidance") != "llguidance":
    raise ValueError(f"MOESERVE_STRUCTURED_BACKEND={os.environ['MOESERVE_STRUCTURED_BACKEND']!r}: structured output "
                     "runs on llguidance only (the hand-written 'builtin' engine was removed); unset the variable "
                     "or set it to 'llguidance'")
MAX_CHOICES = 1_000
COMPILE_CACHE_BYTES = 16 << 20  # the LRU holds checked grammars up to this much grammar text in all


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    # The pattern applies to the text after this one (a reasoning model's "</think>"; the server sets it
    # with --reasoning-parser); before it the output is free. Not part of the compiled pattern.
    after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            try:
                self.json = json.dumps(self.json)  # one canonical, serialisable form; key order kept
            except (RecursionError, ValueError, TypeError) as e:
                raise PatternError(f"the JSON schema cannot be written as JSON: {type(e).__name__}: {e}") from None
        if isinstance(self.structural_tag, dict):
            try:
                self.structural_tag = json.dumps(self.structural_tag)
            except (RecursionError, ValueError, TypeError) as e:
                raise PatternError(f"the structural_tag cannot be written as JSON: {type(e).__name__}: {e}") from None
        given = [k for k in ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise PatternError("structured outputs take exactly one of json, regex, choice, json_object, grammar, "
                               "structural_tag" + (f"; got {', '.join(given)}" if given else ""))
        for k in ("grammar", "structural_tag"):
            if getattr(self, k) is not None and (not isinstance(getattr(self, k), str) or not getattr(self, k)):
                raise PatternError(f"{k} must be a non-empty string")
        if self.regex is not None and not isinstance(self.regex, str):  # a list would be an unhashable cache key
            raise PatternError(f"regex must be a string, got {type(self.regex).__name__}")
        if self.json is not None and not isinstance(self.json, str):
            raise PatternError(f"json must be a JSON schema (an object or its JSON text), got "
                               f"{type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or len(self.choice) > MAX_CHOICES
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise PatternError(f"choice must be a list of 1..{MAX_CHOICES} non-empty strings")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise PatternError("after must be a non-empty string")
        if self.json_object not in (None, True, False):
            raise PatternError("json_object must be true or false")

    @property
    def key(self) -> tuple:
        return ("json", self.json) if self.json is not None else \
            ("regex", self.regex) if self.regex is not None else \
            ("choice", tuple(self.choice)) if self.choice is not None else \
            ("grammar", self.grammar) if self.grammar is not None else \
            ("structural_tag", self.structural_tag) if self.structural_tag is not None else ("json_object",)

    def describe(self) -> str:
        return self.key[0]


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name

_cache: "OrderedDict[tuple, GuidanceGrammar]" = OrderedDict()
_lock = Lock()  # the API server compiles from several request handlers
_compile_here = True  # False in engine processes: grammars arrive checked (EngineCoreRequest.structured_grammar)


def compile_in_this_process(allowed: bool) -> None:
    """Engine-core and rank processes call this with False at start: compiling takes up to seconds and would
    stall every stream of the engine's loop, so there SamplingParams skip it when decoded (the API server or
    LLM that built the request compiled it) and compile_params refuses."""
    global _compile_here
    _compile_here = allowed


def compiling_allowed() -> bool:
    return _compile_here


def compile_params(p: StructuredOutputsParams) -> "GuidanceGrammar":
    """What the output must match as a whole, as a checked llguidance grammar (kept on p, and LRU-cached by the
    spec). Raises PatternError."""
    key = p.key
    held = p.__dict__.get("_compiled")
    if held is not None and held[0] == key:
        return held[1]
    if not _compile_here:
        raise PatternError("structured outputs are not compiled in an engine process; the request must carry "
                           "its checked grammar (EngineCoreRequest.structured_grammar)")
    grammar = _compile_cached(p, key)
    p.__dict__["_compiled"] = (key, grammar)  # not a field: never encoded, compared or copied by replace()
    return grammar


def structured_grammar(sampling_params) -> bytes | None:
    """EngineCoreRequest.structured_grammar of a SamplingParams (the field keeps its old name): its structured
    output's checked grammar as bytes (compiled when the params were built; serialised once per grammar), None
    without one."""
    so = sampling_params.structured_outputs
    if so is None:
        return None
    grammar = compile_params(so)
    if grammar.wire is None:
        grammar.wire = grammar.to_bytes()
    return grammar.wire


def _compile_cached(p: StructuredOutputsParams, key: tuple) -> "GuidanceGrammar":
    from moeserve.structured.guidance import compile_grammar
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    compiled = compile_grammar(p)
    with _lock:
        _cache[key] = compiled
        while len(_cache) > 1 and sum(len(g.grammar) for g in _cache.values()) > COMPILE_CACHE_BYTES:
            _cache.popitem(last=False)
    return compiled
