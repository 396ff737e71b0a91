"""JSON Schema -> byte DFA: every string the automaton accepts is JSON that an independent validator
(jsonschema) accepts, and the JSON a schema describes is accepted (both separators styles)."""
import json
import random

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st
from pydantic import BaseModel

from moeserve.structured.automaton import compile_dfa
from moeserve.structured.json_schema import MAX_DEPTH, SchemaError, json_object, schema_to_pattern


class Address(BaseModel):
    city: str
    zip: str | None = None


class Person(BaseModel):
    name: str
    age: int
    addresses: list[Address]
    best: Address | None = None


class Tree(BaseModel):
    value: int
    children: list["Tree"] = []


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"},
                                      "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", 3, None]},
                                      "x": {"type": ["number", "null"]}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}},
    {"anyOf": [{"type": "integer"}, {"const": {"k": [1, "é"]}}]},
    {"type": "string", "format": "date"},
    {"type": "string", "pattern": "^[A-Z]{2}-\\d{1,3}$"},
    {"type": "object", "additionalProperties": {"type": "boolean"}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    Person.model_json_schema(),
    Tree.model_json_schema(),
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                      "at": {"type": "string", "format": "date-time"}}, "required": ["id", "at"]},
]


def random_accepted(dfa, rng: random.Random, max_len: int = 300) -> bytes | None:
    """A random walk over live transitions, stopping at accepting states with some probability."""
    state, out = 1, bytearray()
    while len(out) < max_len:
        if dfa.accepting[state] and (not dfa.can_continue(state) or rng.random() < 0.2):
            return bytes(out)
        moves = [b for b in range(256) if dfa.transitions[state][dfa.byte_class[b]]]
        b = rng.choice(moves)
        out.append(b)
        state = dfa.step(state, bytes([b]))
    return None


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_everything_accepted_validates(schema):
    dfa = compile_dfa(schema_to_pattern(schema))
    rng, seen = random.Random(0), 0
    for _ in range(300):
        text = random_accepted(dfa, rng)
        if text is None:
            continue
        value = json.loads(text.decode("utf-8"))  # valid UTF-8 and valid JSON
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        seen += 1
    assert seen > 50


def test_instances_are_accepted_and_breaches_refused():
    dfa = compile_dfa(schema_to_pattern(SCHEMAS[0]))
    for text in ['{"name":"bo","age":3}', '{"name": "bo", "age": -3, "ok": true, "tag": null, "x": 1.5e3}',
                 '{"name":"\\"é\\u00e9","age":0,"x":null}']:
        assert dfa.fullmatch(text.encode()), text
    for text in ['{"age":3,"name":"x"}', '{"name":"bo"}', '{"name":"bo","age":03}', '{"name":"toolong","age":1}',
                 '{"name":"bo","age":1,"extra":1}', '{"name":"bo","age":1,"tag":"c"}', '{"name":"bo","age":1.5}',
                 '{"name":"bo","age":1,}', '{"name":"bo","age":1}  ']:
        assert not dfa.fullmatch(text.encode()), text
    person = Person(name="a", age=4, addresses=[Address(city="x")], best=Address(city="y", zip="1"))
    assert compile_dfa(schema_to_pattern(SCHEMAS[8])).fullmatch(person.model_dump_json().encode())


def _nesting(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_nesting, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_nesting, v), default=0)
    return 0


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=5), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                            max_size=3), max_leaves=8)
OBJECT_DFA = compile_dfa(json_object())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=3), JSON, max_size=3), st.booleans(), st.booleans())
def test_json_object_accepts_any_object_within_the_depth(value, spaced, ascii_only):
    text = json.dumps(value, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=ascii_only)
    assert OBJECT_DFA.fullmatch(text.encode()) == (_nesting(value) <= MAX_DEPTH)


@pytest.mark.parametrize("schema,words", [
    ({"type": "integer", "minimum": 0}, "'minimum' is not supported"),
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"$ref": "#/$defs/Missing"}, "does not resolve"),
    ({"$ref": "http://example.com/s.json"}, "only local references"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required' must list keys"),
    ({"type": "string", "maxLength": 10**6}, "'maxLength' must be an integer"),
    ({"type": "wat"}, "unknown type"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "exactly one schema"),
    ({"type": "string", "pattern": "(a"}, "pattern"),
    ("{not json", "not valid JSON"),
    ({"properties": {"a": {"type": "integer", "multipleOf": 2}}}, "#/properties/a"),
])
def test_refusals_name_the_keyword(schema, words):
    with pytest.raises(SchemaError, match=words):
        compile_dfa(schema_to_pattern(schema))


@pytest.mark.parametrize("fmt,parse", [("date", "date"), ("date-time", "datetime"), ("time", "time")])
def test_formats_generate_real_dates_and_times(fmt, parse):
    import datetime
    dfa = compile_dfa(schema_to_pattern({"type": "string", "format": fmt}))
    rng = random.Random(1)
    for _ in range(300):
        text = json.loads(random_accepted(dfa, rng, max_len=80))
        # raises on 31 November, 29 February 2023, ...; RFC 3339 allows a lower-case t / z, Python does not
        getattr(datetime, parse).fromisoformat(text.upper())
    assert dfa.fullmatch(b'"2024-02-29"' if fmt == "date" else b'"2024-02-29T10:00:00Z"' if fmt == "date-time"
                         else b'"23:59:59+01:00"')
    if fmt == "date":
        assert not dfa.fullmatch(b'"2023-02-29"') and not dfa.fullmatch(b'"1900-02-29"')
        assert dfa.fullmatch(b'"2000-02-29"') and not dfa.fullmatch(b'"0000-01-01"')


class Leaf(BaseModel):
    x: int
    meta: dict


class Level3(BaseModel):
    leaf: Leaf


class Level2(BaseModel):
    c: Level3


class Level1(BaseModel):
    b: Level2


@pytest.mark.parametrize("schema", [
    # a string pattern that allows ", \ or control characters: they must come out escaped
    {"type": "string", "pattern": "[^,]{1,4}"},
    {"type": "string", "pattern": "a.b"},
    {"type": "string", "pattern": "a\\nb|\\\\|\"|\\x01"},
    # nesting is not recursion: five models deep, a free-form object at the bottom
    Level1.model_json_schema(),
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"$ref": "#/$defs/d"},
               "d": {"$ref": "#/$defs/e"}, "e": {"$ref": "#/$defs/f"}, "f": {"type": "integer"}}, "$ref": "#/$defs/a"},
    # recursion through the root
    {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["v"]},
], ids=range(6))
def test_more_schemas_accept_only_valid_json(schema):
    test_everything_accepted_validates(schema)


def test_pattern_characters_are_json_escaped():
    dfa = compile_dfa(schema_to_pattern({"type": "string", "pattern": "a\\nb|\\\\|\"|\\x01"}))
    for value in ["a\nb", "\\", '"', "\x01"]:
        assert dfa.fullmatch(json.dumps(value).encode()), value
    assert not dfa.fullmatch(b'"a\nb"') and not dfa.fullmatch(b'"\\"')


def test_a_surrogate_pair_is_one_character():
    # it was two escapes, each counted as a character: minLength 2 let one character through
    dfa = compile_dfa(schema_to_pattern({"type": "string", "minLength": 2, "maxLength": 2}))
    assert dfa.fullmatch(b'"\\u00e9\\uFFFD"') and dfa.fullmatch('"😀a"'.encode())
    assert dfa.fullmatch(b'"\\ud83d\\ude00a"') and not dfa.fullmatch(b'"\\ud83d\\ude00"')
    assert not dfa.fullmatch(b'"\\uDBFFa"') and not dfa.fullmatch(b'"a\\udc00"')  # lone surrogates


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "required": ["a"]}, "'required' must list keys"),  # else {} would come out
    ({"type": "object", "properties": {}, "required": ["a"]}, "'required' must list keys"),
    ({"type": "string", "pattern": "[a-z]*", "minLength": 3}, "'pattern' and 'minLength' together"),
    ({"type": "string", "format": "date", "maxLength": 8}, "'format' and 'maxLength' together"),
])
def test_constraints_that_would_be_dropped_are_refused(schema, words):
    with pytest.raises(SchemaError, match=words):
        compile_dfa(schema_to_pattern(schema))
