"""Oracles independent of llguidance, for its masks and outputs: the `regex` module's partial matches (is a text
a prefix of some match), `re`'s full matches, and (in the tests) jsonschema; and a byte-level random walk of a
checked grammar, whose outputs those oracles then judge."""
from __future__ import annotations

import random

import numpy as np
import regex as rx

from moeserve.structured.guidance import GuidanceGrammar, _byte_tokenizer, limits


def regex_prefix(pattern: str, text: bytes, extra: str = "") -> bool:
    """Whether `text` (bytes) can be continued into a full match of `pattern` (read with re.ASCII, as the
    server reads \\d \\w \\s). A text ending inside a UTF-8 character counts when one of the characters in
    `extra` (the pattern's non-ASCII ones) starts with those bytes and completes a prefix."""
    try:
        return rx.fullmatch(pattern, text.decode("utf-8"), rx.ASCII, partial=True) is not None
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data":
            return False
        head, tail = text[:e.start].decode("utf-8"), text[e.start:]
        return any(c.encode("utf-8").startswith(tail) and rx.fullmatch(pattern, head + c, rx.ASCII, partial=True)
                   for c in extra)


def regex_full(pattern: str, text: bytes) -> bool:
    try:
        return rx.fullmatch(pattern, text.decode("utf-8"), rx.ASCII) is not None
    except UnicodeDecodeError:
        return False


def random_walk(grammar: GuidanceGrammar, rng: random.Random, max_len: int = 300, stop: float = 0.2) -> bytes | None:
    """A random output of the grammar, byte by byte: each step a byte the grammar allows, ending (with
    probability `stop`, or when nothing else is allowed) where the output matches; None past max_len."""
    import llguidance
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar.grammar, log_level=0, limits=limits())
    out = bytearray()
    while len(out) < max_len:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), count=257, bitorder="little")
        moves = np.flatnonzero(bits[:256]).tolist()
        if bits[256] and (not moves or rng.random() < stop):
            return bytes(out)
        assert moves, f"the grammar allows nothing after {bytes(out)!r}"
        b = rng.choice(moves)
        assert m.consume_token(b), m.get_error()
        out.append(b)
    return None


def json_prefix(text: str) -> bool:
    """Whether `text` can be continued into JSON: some short ending (close an open string, a value for a key
    or after a comma, then the open brackets) makes json.loads accept it."""
    import json
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            if not stack or stack.pop() != ch:
                return False
    closers = "".join(reversed(stack))
    opens = ['"'] if in_string else [""]
    if in_string and escaped:
        opens = ['n"']
    for head in opens:
        for tail in ("", "0", "null", '":0', ":0", '"":0'):
            try:
                json.loads(text + head + tail + closers)
                return True
            except ValueError:
                continue
    return False
