"""Structured output on llguidance (vLLM's `guidance` backend), moeserve's only grammar engine.

API server / LLM side (compile_grammar): the request's spec becomes an llguidance grammar (JSON Schema,
regex, choice, Lark or GBNF/EBNF grammar, json_object, structural_tag) and is validated there without a
tokenizer, under LIMITS and MAX_SPEC_BYTES / MAX_COMPILE_S (a PatternError, so a 400, naming the limit
beyond). What travels to the engine is the checked grammar (GuidanceGrammar.to_bytes, tagged WIRE_MAGIC).

Engine side (GuidanceMatcher): one llguidance matcher per request over the engine's tokenizer. llguidance
has no ahead-of-time token-level compile: the matcher is built lazily from the checked grammar and each
step's mask is computed from the parser state (Earley parser + lazily built lexer DFA), bounded per token by
LIMITS' step fuel. The matcher's position is derived from the request's output tokens: drafts are consumed
and rolled back, a preempted request (fewer output tokens) starts again.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict

import numpy as np
import torch

from moeserve.markers import partial_marker_len
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
    """An error when the grammar matches no text at all (`[^\\s\\S]`): llguidance's matcher fails at its start,
    which the engine would only find per request."""
    import llguidance
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits())
    if not m.is_error() and (any(m.compute_bitmask()) or m.is_accepting()) and not m.is_error():
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


def _unpack(bits: bytes, n: int, vocab_size: int) -> np.ndarray:
    """llguidance's bitmask (bit t of 32-bit little-endian words) -> bool [vocab_size]. Rows are built in
    numpy: torch's bool kernels on one 129k row (slice assignment, any, ones) cost ~1-2 ms each on this CPU
    build, numpy's ~0.02 ms."""
    k = min(n, vocab_size)
    out = np.zeros(vocab_size, dtype=np.bool_)
    out[:k] = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=k, bitorder="little").view(np.bool_)
    return out


class GuidanceVocab:
    """The engine's tokenizer as llguidance sees it (from_hf: ~1 s for a 128k vocabulary, once per engine)."""

    def __init__(self, tok, pieces: list[bytes | None], eos: list[int]) -> None:
        self.tok, self.n = tok, tok.vocab_size
        self.pieces, self.vocab_size, self.eos = pieces, len(pieces), eos
        self.thinking: dict[tuple[str, bytes, bytes], np.ndarray | None] = {}
        # A fresh matcher per grammar, copied for each request (deep_copy: ~1 us; building one: ~2-10 ms for a
        # large schema, which the engine's loop then pays once per grammar, not per request).
        self.templates: OrderedDict[str, object] = OrderedDict()

    @classmethod
    def from_hf(cls, tokenizer, pieces: list[bytes | None]) -> "GuidanceVocab":
        import llguidance.hf
        return cls(llguidance.hf.from_tokenizer(tokenizer), pieces,
                   [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])

    def fresh(self, grammar: str):
        import llguidance
        m = self.templates.get(grammar)
        if m is None:
            m = llguidance.LLMatcher(self.tok, grammar, log_level=0, limits=limits())
            if m.is_error():
                raise PatternError(m.get_error())
            self.templates[grammar] = m
            if len(self.templates) > 64:
                self.templates.popitem(last=False)
        else:
            self.templates.move_to_end(grammar)
        return m.deep_copy()


class GuidanceMatcher:
    """One request's llguidance matcher. Its position comes from the request's output tokens (sync), so a
    preempted and recomputed request, or one whose drafts were rejected, needs no rollback of its own.

    With `after` (a reasoning model's end of thinking, b"</think>"), the output is free until that text
    appears and the grammar applies to what follows it; until then `text` holds the output's last bytes
    (enough to find the marker across tokens)."""

    def __init__(self, vocab: GuidanceVocab, grammar: GuidanceGrammar, after: bytes | None = None) -> None:
        self.vocab, self.grammar, self.after = vocab, grammar, after
        self.m = vocab.fresh(grammar.grammar)
        self._restart()

    def _restart(self) -> None:
        self.m.reset()
        self.text: bytes | None = b"" if self.after else None  # thinking: the text's last bytes
        self.dead = False  # a token the grammar forbids was taken (ignore_eos past the end): only stops now
        self.pushed = 0  # tokens in the matcher
        self.consumed = 0  # output tokens seen
        self.prefetched: tuple[int | None, bytes | None] = (None, None)  # (consumed, bitmask): prefetch_masks

    def _push(self, tokens: list[int]) -> bool:
        if not tokens:
            return True
        if self.m.is_stopped() or self.m.validate_tokens(tokens) != len(tokens):
            return False
        if not self.m.consume_tokens(tokens):
            raise PatternError(f"structured output: {self.m.get_error()}")
        self.pushed += len(tokens)
        return True

    def _advance(self, token_id: int) -> None:
        if self.dead:
            return
        if self.text is not None:
            piece = self.vocab.pieces[token_id] if 0 <= token_id < self.vocab.vocab_size else None
            text = self.text + (piece or b"")
            cut = text.find(self.after)
            if cut < 0:
                k = partial_marker_len(text, self.after)
                self.text = text[len(text) - k:] if k else b""
                return
            self.text = None
            tail = text[cut + len(self.after):]
            self.dead = not self._push(self.vocab.tok.tokenize_bytes(tail) if tail else [])
            return
        self.dead = not self._push([token_id]) or self.m.is_stopped()

    def sync(self, output_ids: list[int]) -> None:
        if len(output_ids) < self.consumed:
            self._restart()
        for t in output_ids[self.consumed:]:
            self._advance(t)
        self.consumed = len(output_ids)

    def _thinking_mask(self, matched: bytes) -> np.ndarray | None:
        """Before the marker: every token, except those that complete it with bytes the grammar cannot start
        with (None when there are none). Cached per grammar and matched prefix of the marker."""
        v, marker = self.vocab, self.after
        key = (self.grammar.grammar, marker, matched)
        if key not in v.thinking:
            bad = []
            for t, p in enumerate(v.pieces):
                if not p:
                    continue
                text = matched + p
                cut = text.find(marker)
                if cut < 0:
                    continue
                tail = text[cut + len(marker):]
                toks = v.tok.tokenize_bytes(tail) if tail else []
                if toks and self.m.validate_tokens(toks) != len(toks):  # the matcher is at its start here
                    bad.append(t)
            mask = None
            if bad:
                mask = np.ones(v.vocab_size, dtype=np.bool_)
                mask[bad] = False
            if len(v.thinking) > 4096:
                v.thinking.clear()
            v.thinking[key] = mask
        return v.thinking[key]

    def _mask(self, ends: list[int], fallback_ids, bits: bytes | None = None) -> np.ndarray:
        v = self.vocab
        over = self.dead or self.m.is_stopped()
        if over:
            mask = np.zeros(v.vocab_size, dtype=np.bool_)
        else:
            mask = _unpack(bits if bits is not None else self.m.compute_bitmask(), v.n, v.vocab_size)
            mask[[t for t in v.eos if t < v.vocab_size]] = False  # stops: the request's end_ids, below
        for t in ends:
            piece = v.pieces[t]
            if over:
                ok = True
            elif not piece:
                ok = self.m.is_accepting()
            else:  # a stop token with text: its text stays in the output, which must then match
                ok = self.m.validate_tokens([t]) == 1 and self.m.consume_token(t)
                if ok:
                    ok = self.m.is_accepting()
                    self.m.rollback(1)
            mask[t] = ok
        if not mask.any():  # the pattern is complete (ignore_eos), or no token has the next byte
            mask[[t for t in fallback_ids if t < v.vocab_size]] = True
        return mask

    def row_masks(self, output_ids: list[int], draft_ids: list[int], end_ids: list[int],
                  fallback_ids: list[int] = ()) -> torch.Tensor | None:
        """bool [len(draft_ids) + 1, vocab]: row j may follow output + drafts[:j]. end_ids (the request's
        stop tokens) are allowed where they leave a match: a special one (EOS) where the output matches, one
        with text (a stop_token_ids entry; its text stays in the output) where output + its text does.
        fallback_ids (EOS) only where nothing else is (ignore_eos past the pattern's end). Rows after a
        draft the grammar forbids repeat the row before (that draft is rejected, so they are never used).
        None: no row is constrained yet (thinking)."""
        ends = [t for t in end_ids if 0 <= t < self.vocab.vocab_size]
        self.sync(output_ids)
        saved = (self.text, self.dead, self.pushed)
        self.prefetched, pre = (None, None), self.prefetched
        rows: list[np.ndarray | None] = []
        try:
            for j in range(len(draft_ids) + 1):
                if self.text is not None:
                    rows.append(self._thinking_mask(self.text))
                elif j and self.dead:
                    rows.append(rows[-1])
                else:
                    rows.append(self._mask(ends, fallback_ids, pre[1] if j == 0 and pre[0] == self.consumed else None))
                if j < len(draft_ids):
                    self._advance(draft_ids[j])
        finally:
            if self.pushed > saved[2]:
                self.m.rollback(self.pushed - saved[2])
            self.text, self.dead, self.pushed = saved
        if all(r is None for r in rows):
            return None
        if len(rows) == 1:
            return torch.from_numpy(rows[0]).unsqueeze(0)
        if any(r is None for r in rows):
            free = np.ones(self.vocab.vocab_size, dtype=np.bool_)
            rows = [free if r is None else r for r in rows]
        return torch.from_numpy(np.stack(rows))


_executor = None


def prefetch_masks(batch: list[tuple["GuidanceMatcher", list[int]]]) -> None:
    """The first row's bitmask of every (matcher, output_ids) that will need one, computed in one call on
    llguidance's thread pool (GIL released) instead of one after another; row_masks then uses it."""
    global _executor
    import llguidance
    todo = []
    for m, output_ids in batch:
        m.sync(output_ids)
        if m.text is None and not m.dead and not m.m.is_stopped():
            todo.append(m)
    if len(todo) < 2:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (max(m.vocab.n for m in todo) + 31) // 32
    bitmask = np.zeros((len(todo), words), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr([(m.m, i) for i, m in enumerate(todo)], bitmask.ctypes.data, words * 4,
                                      len(todo))
    for i, m in enumerate(todo):
        m.prefetched = (m.consumed, bitmask[i].tobytes())
