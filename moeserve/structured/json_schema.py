"""JSON Schema -> pattern AST for guided decoding (the JSON text a schema admits, as a regular language).

Output is compact JSON, as most grammar engines generate it: no whitespace except one optional space after
`:` and `,` (unbounded whitespace lets a model loop on blanks). Objects with `properties` emit them in
schema order; required ones always, optional ones maybe; no other keys. Supported: type (and type lists),
properties / required / additionalProperties (false, or a schema when there are no properties),
items / prefixItems / minItems / maxItems, enum, const, anyOf / oneOf, allOf with one member, local $ref
(`#/$defs/...`, `#/definitions/...`, recursion up to MAX_DEPTH), string minLength / maxLength / pattern /
format (date, time, date-time, uuid), and annotations (title, description, default, examples, ...), which
are ignored. Keywords that would constrain values in ways this compiler cannot enforce (minimum, maximum,
multipleOf, uniqueItems, not, if/then/else, ...) are refused with a message naming them, rather than
silently producing JSON that breaks the schema.

Schemaless JSON (`{"type": "object"}` with nothing else, `{}`, OpenAI's json_object mode) is bounded to
MAX_DEPTH levels of nesting: a regular language cannot count brackets without a bound.
"""
from __future__ import annotations

import json

from moeserve.structured.regex import (DIGIT, NOTHING, Alt, Chars, OrderedSubset, PatternError, Repeat, Seq,
                                       char_set, literal, parse)

MAX_DEPTH = 4  # nesting of schemaless objects/arrays, and of recursive $ref expansions
MAX_LENGTH = 2_000  # minLength / maxLength / minItems / maxItems above this are refused
MAX_REF_EXPANSIONS = 2_000  # $ref expansions per schema (each is a copy of the definition)
MAX_NESTING = 64  # subschemas nested deeper (properties, items, anyOf, ...) are refused: the compiler recurses

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
                "writeOnly", "deprecated", "$defs", "definitions", "strict", "discriminator", "nullable"}
_KNOWN = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
          "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern",
          "format"} | _ANNOTATIONS

SPACE = Repeat(literal(" "), 0, 1)
_HEX = char_set([(48, 57), (65, 70), (97, 102)])
# \uXXXX escapes: a non-surrogate, or a high and low surrogate together (one character, as it decodes and as
# minLength counts it); a lone surrogate is not text.
_D = char_set([(68, 68), (100, 100)])
_U_ESCAPE = Seq((literal("u"), Alt((
    Seq((char_set([(48, 57), (65, 67), (69, 70), (97, 99), (101, 102)]), Repeat(_HEX, 3, 3))),
    Seq((_D, char_set([(48, 55)]), Repeat(_HEX, 2, 2))),
    Seq((_D, char_set([(56, 57), (65, 66), (97, 98)]), Repeat(_HEX, 2, 2),
         literal("\\u"), _D, char_set([(67, 70), (99, 102)]), Repeat(_HEX, 2, 2)))))))
_RAW = char_set([(0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF)])  # not " \ or controls: as themselves in JSON
_STRING_CHAR = Alt((_RAW, Seq((literal("\\"), Alt((char_set([(34, 34), (47, 47), (92, 92), (98, 98), (102, 102),
                                                              (110, 110), (114, 114), (116, 116)]),
                                                    _U_ESCAPE))))))
_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_INT = Seq((Repeat(literal("-"), 0, 1), Alt((literal("0"), Seq((char_set([(49, 57)]), Repeat(DIGIT, 0, None)))))))
_NUMBER = Seq((_INT, Repeat(Seq((literal("."), Repeat(DIGIT, 1, None))), 0, 1),
               Repeat(Seq((char_set([(69, 69), (101, 101)]), Repeat(char_set([(43, 43), (45, 45)]), 0, 1),
                           Repeat(DIGIT, 1, None))), 0, 1)))
# RFC 3339 dates: real month lengths, 29 February only in leap years (every 4th, centuries every 4th), no
# year 0000; times with a required offset, as JSON Schema's "time" and "date-time" formats define them.
_YEAR = r"([1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(\d\d(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}


class SchemaError(PatternError):
    """A schema this compiler refuses; the message names the keyword and where it is."""


def schema_to_pattern(schema) -> object:
    """A JSON Schema (dict, or JSON text) -> pattern AST of its compact JSON texts."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return _Compiler(schema if isinstance(schema, dict) else {}).value(schema, "#", 0)


def json_value(depth: int = MAX_DEPTH) -> object:
    """Any JSON value, containers nested at most `depth` deep."""
    scalars = [_string(), _NUMBER, literal("true"), literal("false"), literal("null")]
    if depth > 0:
        inner = json_value(depth - 1)
        scalars += [json_object(depth, inner), _array(inner, 0, None)]
    return Alt(tuple(scalars))


def json_object(depth: int = MAX_DEPTH, values=None) -> object:
    """Any JSON object (OpenAI's json_object mode): keys are strings, values any JSON nested < depth."""
    values = json_value(depth - 1) if values is None else values
    member = Seq((_string(), literal(":"), SPACE, values))
    return Seq((literal("{"), Repeat(Seq((member, Repeat(Seq((literal(","), SPACE, member)), 0, None))), 0, 1),
                literal("}")))


def _json_escaped(node) -> object:
    """A pattern over a string's characters -> the same over its JSON text: `"`, `\\` and control
    characters the pattern allows are written escaped (a raw one would end the string or break the JSON)."""
    if isinstance(node, Chars):
        raw = [(max(lo, a), min(hi, b)) for lo, hi in node.ranges for a, b in _RAW.ranges if max(lo, a) <= min(hi, b)]
        special = [cp for lo, hi in node.ranges for cp in range(lo, min(hi, 0x5C) + 1)
                   if cp < 0x20 or cp in (0x22, 0x5C)]
        if not special:
            return node
        escapes = tuple(literal(_SHORT_ESCAPES.get(cp, f"\\u{cp:04x}")) for cp in special)
        return Alt((char_set(raw),) + escapes)
    if isinstance(node, (Seq, Alt)):
        return type(node)(tuple(_json_escaped(x) for x in node.items))
    if isinstance(node, Repeat):
        return Repeat(_json_escaped(node.item), node.lo, node.hi)
    return node


def _string(lo: int = 0, hi: int | None = None, inner=None) -> object:
    return Seq((literal('"'), inner if inner is not None else Repeat(_STRING_CHAR, lo, hi), literal('"')))


def _array(item, lo: int, hi: int | None) -> object:
    if hi == 0:
        return literal("[]")
    rest = Repeat(Seq((literal(","), SPACE, item)), max(lo - 1, 0), None if hi is None else hi - 1)
    items = Seq((item, rest))
    return Seq((literal("["), items if lo > 0 else Repeat(items, 0, 1), literal("]")))


def _const(value) -> object:
    return literal(json.dumps(value, ensure_ascii=False, separators=(",", ": ")))


class _Compiler:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.expanding: dict[str, int] = {}  # $ref -> how many times it is being expanded now (recursion)
        self.expansions = 0
        self.nesting = 0  # value() calls open now

    def value(self, schema, where: str, depth: int) -> object:
        self.nesting += 1
        try:
            if self.nesting > MAX_NESTING:
                raise SchemaError(f"{where}: subschemas are nested more than {MAX_NESTING} deep")
            return self._value(schema, where, depth)
        finally:
            self.nesting -= 1

    def _value(self, schema, where: str, depth: int) -> object:
        if schema is True or schema == {}:
            return json_value(MAX_DEPTH - depth)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or a boolean, got {type(schema).__name__}")
        unknown = sorted(set(schema) - _KNOWN)
        if unknown:
            raise SchemaError(f"{where}: the keyword {unknown[0]!r} is not supported by guided decoding "
                              f"(it cannot be enforced while generating); remove it")
        if "$ref" in schema:
            return self._ref(schema, where, depth)
        if "const" in schema:
            return _const(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{where}: 'enum' must be a non-empty list")
            return Alt(tuple(_const(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}: '{key}' must be a non-empty list of schemas")
                base = {k: v for k, v in schema.items() if k != key}
                return Alt(tuple(self.value({**base, **o} if isinstance(o, dict) else o, f"{where}/{key}/{i}",
                                            depth) for i, o in enumerate(options)))
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
                raise SchemaError(f"{where}: 'allOf' is supported with exactly one schema")
            return self.value({**{k: v for k, v in schema.items() if k != "allOf"}, **parts[0]}, where, depth)
        kind = schema.get("type")
        if kind is None:
            kind = self._implied_type(schema)
        if isinstance(kind, list):
            if not kind:
                raise SchemaError(f"{where}: 'type' must not be an empty list")
            return Alt(tuple(self._typed(schema, k, where, depth) for k in kind))
        return self._typed(schema, kind, where, depth)

    @staticmethod
    def _implied_type(schema: dict):
        if "properties" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        if {"pattern", "format", "minLength", "maxLength"} & set(schema):
            return "string"
        return ["string", "number", "boolean", "null", "object", "array"]

    def _typed(self, schema: dict, kind, where: str, depth: int) -> object:
        if kind == "string":
            return self._string(schema, where)
        if kind == "integer":
            return _INT
        if kind == "number":
            return _NUMBER
        if kind == "boolean":
            return Alt((literal("true"), literal("false")))
        if kind == "null":
            return literal("null")
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            return self._array(schema, where, depth)
        raise SchemaError(f"{where}: unknown type {kind!r}")

    def _string(self, schema: dict, where: str) -> object:
        given = [k for k in ("pattern", "format", "minLength", "maxLength") if k in schema]
        if len(given) > 1 and {"pattern", "format"} & set(given):
            # The automaton cannot intersect two constraints: using one would break the other.
            raise SchemaError(f"{where}: {' and '.join(repr(k) for k in given)} together are not supported by "
                              "guided decoding (only one can be enforced); fold the lengths into 'pattern' "
                              "(e.g. '^[a-z]{3,8}$') or keep one of them")
        if "pattern" in schema:
            try:
                return _string(inner=_json_escaped(parse(schema["pattern"])))
            except PatternError as e:
                raise SchemaError(f"{where}/pattern: {e}") from None
        if "format" in schema:
            fmt = schema["format"]
            if not isinstance(fmt, str) or fmt not in _FORMATS:
                raise SchemaError(f"{where}: string format {fmt!r} is not supported (supported: "
                                  f"{', '.join(sorted(_FORMATS))}); remove it or use 'pattern'")
            return _string(inner=parse(_FORMATS[fmt]))
        lo, hi = self._bounds(schema, "minLength", "maxLength", where)
        return _string(lo, hi)

    def _bounds(self, schema: dict, lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
        lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LENGTH):
                raise SchemaError(f"{where}: '{key}' must be an integer in [0, {MAX_LENGTH}], got {v!r}")
        if hi is not None and hi < lo:
            raise SchemaError(f"{where}: '{hi_key}' ({hi}) is below '{lo_key}' ({lo})")
        return lo, hi

    def _object(self, schema: dict, where: str, depth: int) -> object:
        props = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if schema.get("required") and not props:  # the generic object below would leave the keys out
            props = {}
        elif props is None or (not props and extra is not False):
            # A free-form object deep in a schema still gets one level (scalar values), not nothing.
            levels = max(MAX_DEPTH - depth, 1)
            values = json_value(levels - 1) if extra in (True, {}) else \
                self.value(extra, f"{where}/additionalProperties", depth + 1)
            return json_object(levels, values)
        if not isinstance(props, dict):
            raise SchemaError(f"{where}: 'properties' must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
            missing = [r for r in required if not isinstance(r, str) or r not in props] \
                if isinstance(required, list) else required
            raise SchemaError(f"{where}: 'required' must list keys of 'properties' (not {missing!r})")
        members = tuple(Seq((_const(str(k)), literal(":"), SPACE, self.value(v, f"{where}/properties/{k}", depth + 1)))
                        for k, v in props.items())
        subset = OrderedSubset(members, tuple(k in required for k in props), Seq((literal(","), SPACE)))
        return Seq((literal("{"), subset, literal("}")))

    def _array(self, schema: dict, where: str, depth: int) -> object:
        lo, hi = self._bounds(schema, "minItems", "maxItems", where)
        if "prefixItems" in schema:
            prefix = schema["prefixItems"]
            if not isinstance(prefix, list) or schema.get("items", False) is not False:
                raise SchemaError(f"{where}: 'prefixItems' is supported as a fixed tuple (with 'items': false)")
            items = [self.value(s, f"{where}/prefixItems/{i}", depth + 1) for i, s in enumerate(prefix)]
            if not items:
                return literal("[]")
            body = [items[0]] + [Seq((literal(","), SPACE, x)) for x in items[1:]]
            return Seq((literal("["), *body, literal("]")))
        item_schema = schema.get("items", True)  # free-form items deep in a schema: scalars (json_value)
        return _array(self.value(item_schema, f"{where}/items", depth + 1), lo, hi)

    def _ref(self, schema: dict, where: str, depth: int) -> object:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"{where}: only local references like '#/$defs/Name' are supported, got {ref!r}")
        # Only recursion is bounded, not nesting: a chain of models 5 deep is fine, a tree unrolls to
        # MAX_DEPTH levels (an optional branch simply ends there).
        if self.expanding.get(ref, 0) >= MAX_DEPTH:
            return NOTHING
        self.expansions += 1
        if self.expansions > MAX_REF_EXPANSIONS:  # definitions that each use the next several times
            raise SchemaError(f"{where}: the schema expands to more than {MAX_REF_EXPANSIONS} references; "
                              "simplify it")
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):  # JSON pointer: an index
                target = target[int(part)]
                continue
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}: reference {ref!r} does not resolve in the schema")
            target = target[part]
        siblings = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
        merged = {**target, **siblings} if isinstance(target, dict) else target
        self.expanding[ref] = self.expanding.get(ref, 0) + 1
        try:
            return self.value(merged, ref, depth)
        finally:
            self.expanding[ref] -= 1


