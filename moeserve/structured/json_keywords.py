"""JSON Schema keywords a grammar cannot enforce, and what to write instead.

llguidance refuses them ("Unimplemented keys: [...]", as vLLM's guidance backend reports it): `uniqueItems`
compares items with each other and `not` negates a language, which no context-free grammar does in general;
`if` / `then` / `else` and the dependent* keywords are not implemented there. Dropping them silently would
let outputs through that the schema forbids, so the 400 names each one, where it is, and the change to make.
"""
from __future__ import annotations

import json

_IF = ("write the cases as alternatives: \"anyOf\": [{the 'if' and 'then' schemas merged}, {the other "
       "case}]")
ADVICE = {
    "uniqueItems": "remove it and check (or deduplicate) the parsed array's items",
    "if": _IF, "then": _IF, "else": _IF,
    "not": "list what is allowed instead (\"enum\", \"const\", \"type\", \"anyOf\")",
    "dependentRequired": "write the cases as \"anyOf\" of objects with and without the dependent keys",
    "dependentSchemas": "write the cases as \"anyOf\" of objects with and without the dependent keys",
    "contains": "give the array \"prefixItems\" whose first item is the required one",
    "propertyNames": "list the allowed names in \"properties\" (with \"additionalProperties\": false)",
}
LENIENT = ("; or add \"x-guidance\": {\"lenient\": true} to the schema to generate without those keywords "
           "(then they are not enforced)")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # dicts of name -> schema
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "not",
        "if", "then", "else", "contains", "propertyNames")


def drop_noops(node: dict) -> dict:
    """`"uniqueItems": false` constrains nothing: dropped rather than refused (on an array schema node)."""
    if node.get("uniqueItems") is False and ("items" in node or "prefixItems" in node or node.get("type") == "array"):
        node = {k: v for k, v in node.items() if k != "uniqueItems"}
    return node


def _found(node, path: str, out: list[tuple[str, str]], depth: int = 0) -> None:
    if not isinstance(node, dict) or depth > 200:
        return
    for k, v in node.items():
        if k in ADVICE and not (k == "uniqueItems" and v is False):
            out.append((k, path or "#"))
        if k in _NAMED and isinstance(v, dict):
            for name, sub in v.items():
                _found(sub, f"{path or '#'}/{k}/{name}", out, depth + 1)
        elif k in _LISTS and isinstance(v, list):
            for i, sub in enumerate(v):
                _found(sub, f"{path or '#'}/{k}/{i}", out, depth + 1)
        elif k in _ONE:
            for i, sub in enumerate(v) if isinstance(v, list) else [(None, v)]:
                _found(sub, f"{path or '#'}/{k}" + ("" if i is None else f"/{i}"), out, depth + 1)


def explain(err: str, schemas: list[tuple[str, object]]) -> str:
    """llguidance's error for the schemas [(where, schema)], with each unenforceable keyword named, located
    and given its fix when the error is an "Unimplemented keys" one; otherwise the error as it was."""
    if "Unimplemented keys" not in err:
        return err
    found: list[tuple[str, str]] = []
    for where, schema in schemas:
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError:
            continue
        hits: list[tuple[str, str]] = []
        _found(schema, "", hits)
        found += [(k, f"{where}{at}" if where else at) for k, at in hits]
    if not found:
        return err
    parts, seen = [], set()
    for k, at in found:
        advice = ADVICE[k] if ADVICE[k] not in seen else "as above"
        seen.add(ADVICE[k])
        parts.append(f"'{k}' at {at}: {advice}")
    return (f"the JSON schema uses keywords that the grammar engine (llguidance) cannot enforce: "
            f"{'; '.join(parts)}{LENIENT}")
