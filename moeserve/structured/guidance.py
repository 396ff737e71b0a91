"""Structured output on llguidance (vLLM's `guidance` backend), moeserve's only grammar engine: the API server
/ LLM side.

compile_grammar: the request's spec becomes an llguidance grammar (JSON Schema, regex, choice, Lark or
GBNF/EBNF grammar, json_object, structural_tag) and is validated there without a tokenizer, under LIMITS and
MAX_SPEC_BYTES / MAX_COMPILE_S (a PatternError, so a 400, naming the limit beyond). What travels to the engine
is the checked grammar (GuidanceGrammar.to_bytes, tagged WIRE_MAGIC); the engine's side is
structured/matcher.py.
"""
from __future__ import annotations

import json
import time

from moeserve.structured import json_keywords, struct_tag
from moeserve.structured.errors import PatternError

WIRE_MAGIC = b"LLG1\n"
MAX_SPEC_BYTES = 1 << 20  # the spec's text (schema, regex, grammar) as sent by the client
MAX_NESTING = 50  # groups (regex) / brackets (grammar) nested deeper are refused: parsers recurse per level
MAX_JSON_DEPTH = 128  # objects and arrays of a JSON schema nested deeper are refused (likewise)
MAX_COMPILE_S = 2.0  # validating the grammar took longer: the engine's matcher would take as long on its loop
# JSON takes at most one space between its tokens: both json.dumps styles ('{"a": 1}', '{"a":1}'), no blanks
# before or after. Unbounded whitespace lets a model fill max_tokens with blanks. A schema's own "x-guidance"
# options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": " ?"}
_LIMITS = dict(max_grammar_size=500_000, max_lexer_states=250_000, initial_lexer_fuel=1_000_000,
               step_lexer_fuel=200_000, step_max_items=50_000, max_items_in_row=2_000)


def limits():
    import llguidance
    return llguidance.LLParserLimits(**_LIMITS)


_BYTES = None


def _byte_tokenizer():
    """An llguidance tokenizer whose tokens are the 256 bytes (and an end token, 256)."""
    global _BYTES
    if _BYTES is None:
        import llguidance

        class Bytes:
            eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
            tokens = [bytes([b]) for b in range(256)] + [b"<end>"]

            def __call__(self, s):
                return list(s.encode("utf-8") if isinstance(s, str) else s)
        _BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    return _BYTES


class GuidanceGrammar:
    """A checked llguidance grammar: what compile_params returns under this backend."""

    def __init__(self, grammar: str) -> None:
        self.grammar = grammar
        self.wire: bytes | None = None  # to_bytes(), kept once a request sent it (structured/params.py)

    def fullmatch(self, text: bytes) -> bool:
        """Whether `text` as a whole matches (read byte by byte; for tests and tools, not the engine)."""
        import llguidance
        m = llguidance.LLMatcher(_byte_tokenizer(), self.grammar, log_level=0, limits=limits())
        toks = list(text)
        return not m.is_error() and m.validate_tokens(toks) == len(toks) and m.consume_tokens(toks) \
            and m.is_accepting()

    def to_bytes(self) -> bytes:
        return WIRE_MAGIC + self.grammar.encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> "GuidanceGrammar":
        if not data.startswith(WIRE_MAGIC):
            raise ValueError("not an llguidance grammar")
        if len(data) > 16 * MAX_SPEC_BYTES:
            raise ValueError(f"the grammar is larger than {16 * MAX_SPEC_BYTES} bytes")
        return cls(data[len(WIRE_MAGIC):].decode("utf-8"))


def _closed_objects(node, depth: int = 0):
    """An object schema with `properties` and no `additionalProperties` takes no other keys (as vLLM with
    disable_additional_properties): a model would otherwise add keys of its own. An explicit `additionalProperties` (true, or a schema) is kept."""
    if depth > MAX_JSON_DEPTH:
        raise PatternError(f"the JSON schema is nested more than {MAX_JSON_DEPTH} levels (objects and arrays) deep")
    if isinstance(node, list):
        return [_closed_objects(v, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("const", "enum", "default", "examples") else _closed_objects(v, depth + 1))
           for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    out = json_keywords.drop_noops(out)
    return out


def _json_grammar(schema) -> str:
    import llguidance
    try:
        schema = _closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
    except PatternError:
        raise
    except ValueError as e:
        raise PatternError(f"the JSON schema is not JSON: {e}") from None
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def _legacy_tag(tag):
    """vLLM's {"format": ...} structural tag as the legacy {triggers, structures} llguidance takes."""
    if isinstance(tag, dict) and "format" in tag and "structures" not in tag:
        return struct_tag.legacy(tag["format"])
    return tag


def _structural_tag(spec) -> str:
    import llguidance
    try:
        tag = _legacy_tag(json.loads(spec) if isinstance(spec, str) else spec)
        triggers = tag["triggers"]
        tags = []
        for s in tag["structures"]:
            trig = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trig is None:
                raise PatternError(f"structural_tag: the begin {s['begin']!r} starts with none of the triggers")
            schema = s["schema"]
            schema = _closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
            tags.append(llguidance.StructTag(trigger=trig, begin=s["begin"], grammar=schema, end=s["end"]))
    except PatternError:
        raise
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise PatternError(f"structural_tag must be {{triggers: [...], structures: [{{begin, schema, end}}]}}: "
                           f"{type(e).__name__}: {e}") from None
    if not tags:
        raise PatternError("structural_tag has no structures")
    # Triggers are text (the API server has no tokenizer to tell which <...> are special tokens).
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def compile_grammar(p) -> GuidanceGrammar:
    """The llguidance grammar of a StructuredOutputsParams, checked. Raises PatternError."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    text = p.json or p.regex or p.grammar or p.structural_tag or (json.dumps(p.choice) if p.choice else "")
    if len(text.encode("utf-8")) > MAX_SPEC_BYTES:
        raise PatternError(f"the {p.describe()} is larger than {MAX_SPEC_BYTES} bytes")
    t0 = time.perf_counter()
    try:
        if p.json is not None:
            g = _json_grammar(p.json)
        elif p.regex is not None:
            g = llguidance.LLMatcher.grammar_from_regex(ascii_classes(p.regex))
        elif p.choice is not None:
            g = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice))
        elif p.grammar is not None:
            _check_brackets(p.grammar) if not p.grammar.lstrip().startswith("{") else json.loads(p.grammar)
            g = p.grammar if p.grammar.lstrip().startswith("{") else \
                llguidance.LLMatcher.grammar_from_lark(any_to_lark(p.grammar))
        elif p.structural_tag is not None:
            g = _structural_tag(p.structural_tag)
        else:
            g = _json_grammar('{"type": "object"}')
    except PatternError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's converters raise ValueError and friends
        raise PatternError(f"{type(e).__name__}: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(g, None, limits=limits())
    if not err and (p.regex is not None or p.grammar is not None):
        err = _matches_nothing(g, p.describe())
    took = time.perf_counter() - t0
    if err:
        raise PatternError(f"the {p.describe()} is too large: {err}" if "limit" in err.lower() else
                           json_keywords.explain(err, _schemas(p)))
    if took > MAX_COMPILE_S:
        raise PatternError(f"the {p.describe()} is too complex: checking it took {took:.1f} s, more than the "
                           f"{MAX_COMPILE_S} s limit; simplify it")
    return GuidanceGrammar(g)


def _matches_nothing(grammar: str, what: str) -> str:
    """An error when the grammar matches no text at all (`[^\\s\\S]`): llguidance's matcher fails on its first
    mask (not before), which the engine would only find per request."""
    import llguidance
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits())
    allowed = not m.is_error() and any(m.compute_bitmask())  # a byte, or the end (bit 256)
    if allowed and not m.is_error():
        return ""
    first = m.get_error().splitlines()[0] if m.get_error() else ""
    return f"the {what} matches no text" + (f" ({first})" if first and first != "NoExtensionBias" else "")


def _schemas(p) -> list[tuple[str, object]]:
    """The JSON schemas in a spec, with where they are (for error messages)."""
    if p.json is not None:
        return [("", p.json)]
    if p.structural_tag is not None:
        try:
            tag = _legacy_tag(json.loads(p.structural_tag))
            return [(f"structures[{i}].schema ", s.get("schema")) for i, s in enumerate(tag.get("structures", []))]
        except (ValueError, AttributeError):  # PatternError included
            return []
    return []


_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(regex: str) -> str:
    """\\d \\w \\s and \\D \\W \\S as ASCII classes: Rust's regex syntax, which
    llguidance reads, makes them Unicode; JSON Schema's ECMA-262 and Python's re with re.ASCII read them as
    ASCII ([0-9], not every script's digits)."""
    out, i, depth, groups = [], 0, 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            if e.lower() in _ASCII_CLASSES:  # inside brackets \D is a nested class: Rust takes [a[^0-9]]
                cls = _ASCII_CLASSES[e.lower()]
                out.append(cls if depth and e.islower() else f"[{'' if e.islower() else '^'}{cls}]")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if c == "[" and depth == 0:
            depth = 1
            out.append(c)
            if regex[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1:i + 2] == "]":  # a leading ] is a literal
                out.append("\\]")
                i += 1
        elif c == "]" and depth:
            depth = 0
            out.append(c)
        else:
            if not depth and c in "()":
                groups += 1 if c == "(" else -1
                if groups > MAX_NESTING:
                    raise PatternError(f"groups are nested more than {MAX_NESTING} deep")
            out.append(c)
        i += 1
    return "".join(out)


def _check_brackets(text: str) -> None:
    depth = 0
    for c in text:
        depth += 1 if c in "([{" else -1 if c in ")]}" else 0
        if depth > MAX_NESTING:
            raise PatternError(f"brackets are nested more than {MAX_NESTING} deep")
