"""Fuzzing a real server: request bodies drawn from the JSON schemas its /openapi.json publishes, plus
arbitrary JSON and broken bytes, posted over HTTP. Shared by the bounded test (tests/entrypoints/test_fuzz.py)
and the long release run (scripts/fuzz_server.py).

from_schema covers the JSON-schema subset pydantic writes ($ref, anyOf, enum/const, typed scalars with
bounds, arrays, objects with required and optional properties), with edge values (bounds, huge, tiny, -0.0)
drawn often. (hypothesis-jsonschema would do this, but its release fails with the hypothesis installed here.)"""
from __future__ import annotations

import copy
import json

import httpx
from hypothesis import strategies as st

# Caps that keep one generated request cheap on a tiny model (the long run may lift them): the fields
# that scale the work, not the ones that test validation.
CHEAP = {"max_tokens": 8, "max_completion_tokens": 8, "n": 3, "best_of": 3, "logprobs": 5, "top_logprobs": 5,
         "prompt_logprobs": 5, "min_tokens": 8}


def body_schemas(openapi: dict) -> dict[str, dict]:
    """POST path -> a standalone JSON schema of its request body (refs rewritten to local $defs)."""
    defs = openapi.get("components", {}).get("schemas", {})
    out = {}
    for path, ops in openapi["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
        if "$ref" in body.get("schema", {}):
            schema = _local_refs({"$ref": body["schema"]["$ref"], "$defs": copy.deepcopy(defs)})
            out[path] = schema
    return out


def _local_refs(node):
    if isinstance(node, dict):
        return {k: (v.replace("#/components/schemas/", "#/$defs/") if k == "$ref" else _local_refs(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    return node


def capped(schema: dict, caps: dict[str, int], model: str | None = None) -> dict:
    """The schema with an upper bound on the work-scaling integer fields (see CHEAP), and `model` mostly the
    served one (else nearly every body would stop at model_not_found)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            props = node.get("properties", {})
            for name, cap in caps.items():
                if name in props:
                    props[name] = {"anyOf": [{"type": "integer", "minimum": -2, "maximum": cap}, {"type": "null"}]}
            if model is not None and "model" in props:
                props["model"] = {"enum": [model, None, model + "x"]}
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return schema


def from_schema(schema: dict, defs: dict | None = None) -> st.SearchStrategy:
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, defs) for k in kind])
    make = _SCALARS.get(kind)
    if make is not None:
        return make(schema)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs)
        lo = schema.get("minItems", 0)
        return st.lists(items, min_size=lo, max_size=max(lo, min(schema.get("maxItems", 4), 4)))
    if kind == "object" and "properties" in schema:
        props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    return JSON  # an object of anything, or no type at all


def _integers(s: dict) -> st.SearchStrategy:
    lo = s.get("minimum", s["exclusiveMinimum"] + 1 if "exclusiveMinimum" in s else None)
    hi = s.get("maximum", s["exclusiveMaximum"] - 1 if "exclusiveMaximum" in s else None)
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31, 2**63, -2**63)
             if v is not None and (lo is None or v >= lo) and (hi is None or v <= hi)]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi)) if edges else st.integers(lo, hi)


def _numbers(s: dict) -> st.SearchStrategy:
    lo, hi = s.get("minimum"), s.get("maximum")
    edges = [v for v in (lo, hi, 0.0, -0.0, 1.0, 1e-300, 1e300, -1e300, 5e-324)
             if v is not None and (lo is None or v >= lo) and (hi is None or v <= hi)]
    plain = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(edges), plain) if edges else plain


def _strings(s: dict) -> st.SearchStrategy:
    lo = s.get("minLength", 0)
    return st.text(min_size=lo, max_size=max(lo, min(s.get("maxLength", 40), 40)))


_SCALARS = {"integer": _integers, "number": _numbers, "string": _strings,
            "boolean": lambda s: st.booleans(), "null": lambda s: st.none()}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=20)


def bodies(schema: dict) -> st.SearchStrategy[bytes]:
    """Mostly schema-valid bodies, some arbitrary JSON, some bytes that are not JSON at all."""
    valid = from_schema(schema).map(lambda v: json.dumps(v, allow_nan=True).encode())
    junk = JSON.map(lambda v: json.dumps(v, allow_nan=True).encode())
    return st.one_of(valid, valid, valid, junk, st.binary(max_size=64))


def post(client: httpx.Client, url: str, body: bytes) -> httpx.Response:
    return client.post(url, content=body, headers={"content-type": "application/json"})
