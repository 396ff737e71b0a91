"""vLLM's newer structural tag, `{"format": {...}}` (xgrammar's structural-tag language), in the part that
llguidance can express: triggered tags whose content is a JSON schema, which is exactly the legacy
`{"triggers": [...], "structures": [{"begin", "schema", "end"}]}` that llguidance's StructTag takes. The rest of
that language (sequence, or, regex / grammar content, at_least_one, stop_after_first, excludes, token
triggers, XML styles) has no llguidance equivalent here and is a 400 naming what was given.
"""
from __future__ import annotations

from moeserve.structured.errors import PatternError

SUPPORTED = ("only \"format\": {\"type\": \"triggered_tags\", \"triggers\": [...], \"tags\": [{\"begin\", "
             "\"content\": {\"type\": \"json_schema\", \"json_schema\": {...}}, \"end\"}]} is supported (or the "
             "legacy \"triggers\" and \"structures\")")


def legacy(fmt) -> dict:
    """The legacy structural tag of a `format`; raises PatternError for what has no equivalent."""
    if not isinstance(fmt, dict) or fmt.get("type") != "triggered_tags":
        got = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise PatternError(f"structural_tag format type {got!r}: {SUPPORTED}")
    for key, default in (("at_least_one", False), ("stop_after_first", False), ("excludes", [])):
        if fmt.get(key, default) not in (default, None):
            raise PatternError(f"structural_tag format {key!r} is not supported: {SUPPORTED}")
    structures = []
    for i, tag in enumerate(fmt.get("tags") or []):
        content = tag.get("content") if isinstance(tag, dict) else None
        if not isinstance(content, dict) or content.get("type") != "json_schema" or \
                content.get("style", "json") != "json" or tag.get("type", "tag") != "tag" or \
                not isinstance(tag.get("begin"), str) or not isinstance(tag.get("end"), str):
            raise PatternError(f"structural_tag format tags[{i}]: {SUPPORTED}")
        structures.append({"begin": tag["begin"], "schema": content.get("json_schema"), "end": tag["end"]})
    return {"triggers": fmt.get("triggers"), "structures": structures}
