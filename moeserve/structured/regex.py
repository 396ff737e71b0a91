"""A regular-expression parser for structured output: pattern text -> a small AST over Unicode code points.

The syntax is the common subset of Python's `re` and JSON Schema's `pattern`: literals, `.`, classes
`[a-z\\d]` / `[^...]`, `\\d \\w \\s` (ASCII, as JSON Schema and most grammar engines read them) and their
negations, groups `( )`, `(?: )`, `(?P<name> )`, alternation, `* + ? {n} {n,} {n,m}` (a lazy `?` suffix
matches the same strings, so it is accepted), and `^` / `$` / `\\A` / `\\Z` at the ends (the whole output
always has to match). Constructs that are not regular or that change matching (back-references,
look-around, `\\b`, inline flags, possessive quantifiers) are refused with a message naming them.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not encodable in UTF-8, so never part of a character set
MAX_REPEAT = 10_000  # {n,m} bounds above this are refused (each repetition is a copy in the automaton)
MAX_NESTING = 50  # groups nested deeper are refused (the parser and the automaton builder recurse per level)


class PatternError(ValueError):
    """A pattern this parser refuses; the message says what and where."""


@dataclass(frozen=True)
class Chars:
    """One character out of sorted, disjoint, non-adjacent code-point ranges [(lo, hi), ...]."""
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True)
class OrderedSubset:
    """items in order, separated by `separator`; those whose required flag is False may be left out
    (JSON object members). Not expressible in regex syntax without exponential blow-up."""
    items: tuple
    required: tuple[bool, ...]
    separator: object


NOTHING = Chars(())  # matches no string (an alternative that can never be taken)
EMPTY = Seq(())  # matches only the empty string


def char_set(ranges) -> Chars:
    """Normalise ranges: sorted, merged, surrogates removed."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in _without_surrogates(lo, hi):
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return Chars(tuple((a, b) for a, b in out))


def _without_surrogates(lo: int, hi: int):
    s_lo, s_hi = SURROGATES
    if hi < s_lo or lo > s_hi:
        return [(lo, hi)] if lo <= hi else []
    return [(a, b) for a, b in ((lo, s_lo - 1), (s_hi + 1, hi)) if a <= b]


def negate(c: Chars) -> Chars:
    out, start = [], 0
    for lo, hi in c.ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return char_set(out)


def literal(text: str) -> Seq:
    """The exact string `text`."""
    return Seq(tuple(Chars(((ord(ch), ord(ch)),)) for ch in text))


DIGIT = char_set([(48, 57)])
WORD = char_set([(48, 57), (65, 90), (95, 95), (97, 122)])
SPACE = char_set([(9, 13), (32, 32)])
ANY_BUT_NEWLINE = negate(char_set([(10, 10)]))
_CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": negate(DIGIT), "W": negate(WORD), "S": negate(SPACE)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


def parse(pattern: str):
    """Pattern text -> AST (Chars / Seq / Alt / Repeat). Raises PatternError."""
    if not isinstance(pattern, str):
        raise PatternError(f"a pattern must be a string, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.depth = 0  # groups open at pos

    def error(self, what: str) -> PatternError:
        return PatternError(f"{what} at position {self.pos} of pattern {self.text!r}")

    def peek(self) -> str | None:
        return self.text[self.pos] if self.pos < len(self.text) else None

    def take(self) -> str:
        ch = self.peek()
        if ch is None:
            raise self.error("unexpected end")
        self.pos += 1
        return ch

    def parse(self):
        node = self.alternation(top=True)
        if self.pos != len(self.text):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self, top: bool = False):
        items = [self.sequence(top)]
        while self.peek() == "|":
            self.pos += 1
            items.append(self.sequence(top))
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def sequence(self, top: bool):
        items = []
        if top:  # `^` / `\\A` starting the pattern or a top-level alternative (`^a$|^b$`)
            for anchor in ("^", "\\A"):
                if self.text.startswith(anchor, self.pos):
                    self.pos += len(anchor)
                    break
        while (ch := self.peek()) is not None and ch not in "|)":
            if top and self._at_end_anchor():
                break
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def _at_end_anchor(self) -> bool:
        """`$` or `\\Z` that ends the pattern (or a top-level alternative): consumed, matches nothing extra."""
        for anchor in ("$", "\\Z"):
            if self.text.startswith(anchor, self.pos):
                after = self.pos + len(anchor)
                if after == len(self.text) or self.text[after] == "|":
                    self.pos = after
                    return True
        return False

    def quantified(self):
        node = self.atom()
        while True:
            ch = self.peek()
            if ch == "*":
                lo, hi = 0, None
            elif ch == "+":
                lo, hi = 1, None
            elif ch == "?":
                lo, hi = 0, 1
            elif ch == "{" and (bounds := self._braces()) is not None:
                lo, hi = bounds
            else:
                return node
            if ch != "{":
                self.pos += 1
            if self.peek() == "?":  # lazy: the same set of strings
                self.pos += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
            node = Repeat(node, lo, hi)

    def _braces(self) -> tuple[int, int | None] | None:
        """`{n}`, `{n,}`, `{n,m}` at pos (consumed), or None: a literal `{` as in Python's re."""
        end = self.text.find("}", self.pos)
        if end < 0:
            return None
        body = self.text[self.pos + 1: end]
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s and comma and _digits(hi_s):  # Python reads {,m} as {0,m}, JSON Schema as text
            raise self.error(f"write {{0,{hi_s}}} for {{,{hi_s}}} (regex dialects disagree on it)")
        if not _digits(lo_s) or (hi_s and not _digits(hi_s)) or (not comma and hi_s):
            return None
        lo = int(lo_s)
        hi = lo if not comma else (int(hi_s) if hi_s else None)
        if hi is not None and hi < lo:
            raise self.error(f"repeat bounds {{{body}}} have max < min")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repeat bound {{{body}}} is above {MAX_REPEAT}")
        self.pos = end + 1
        return lo, hi

    def atom(self):
        ch = self.take()
        if ch == "(":
            if self.peek() == "?":
                self.pos += 1
                kind = self.take()
                if kind == "P" and self.peek() == "<":
                    close = self.text.find(">", self.pos)
                    if close < 0:
                        raise self.error("unterminated group name")
                    self.pos = close + 1
                elif kind != ":":
                    raise self.error(f"'(?{kind}' (look-around, flags, references) is not supported")
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise self.error(f"groups are nested more than {MAX_NESTING} deep")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.pos += 1
            self.depth -= 1
            return node
        if ch == "[":
            return self.char_class()
        if ch == ".":
            return ANY_BUT_NEWLINE
        if ch == "\\":
            return self.escape(in_class=False)
        if ch in "*+?":
            raise self.error(f"nothing to repeat before {ch!r}")
        if ch in "^$":
            raise self.error(f"anchor {ch!r} is only supported at the start/end of the pattern")
        return Chars(((ord(ch), ord(ch)),))

    def escape(self, in_class: bool) -> Chars:
        ch = self.take()
        if ch in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[ch]
        if ch == "0":  # Python's octal escape: \\0 and up to two more octal digits (\\012 is a newline)
            digits = "0"
            while len(digits) < 3 and self.peek() is not None and self.peek() in "01234567":
                digits += self.take()
            return _point(int(digits, 8))
        if ch in _CHAR_ESCAPES:
            return _point(ord(_CHAR_ESCAPES[ch]))
        if ch == "b" and in_class:
            return _point(8)
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.text[self.pos: self.pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{ch} needs {width} hex digits")
            self.pos += width
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT:
                raise self.error(f"\\{ch}{digits} is not a code point")
            return _point(cp)
        if ch.isalnum():
            raise self.error(f"escape '\\{ch}' (word boundaries, back-references, ...) is not supported")
        return _point(ord(ch))

    def char_class(self) -> Chars:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        members: list[Chars] = []
        first = True
        while True:
            ch = self.peek()
            if ch is None:
                raise self.error("missing ']'")
            if ch == "]" and not first:
                self.pos += 1
                break
            first = False
            if ch == "[" and self.text.startswith("[:", self.pos):
                raise self.error("POSIX classes like [:alpha:] are not supported")
            lo = self._class_member()
            if len(lo.ranges) != 1 or lo.ranges[0][0] != lo.ranges[0][1]:  # \d, \w, ...: no range
                members.append(lo)
                continue
            if self.peek() == "-" and self.text[self.pos + 1: self.pos + 2] not in ("]", ""):
                self.pos += 1
                hi = self._class_member()
                if len(hi.ranges) != 1 or hi.ranges[0][0] != hi.ranges[0][1]:
                    raise self.error("a class escape cannot end a range")
                if hi.ranges[0][0] < lo.ranges[0][0]:
                    raise self.error("bad character range")
                members.append(char_set([(lo.ranges[0][0], hi.ranges[0][0])]))
            else:
                members.append(lo)
        c = char_set([r for m in members for r in m.ranges])
        return negate(c) if negated else c

    def _class_member(self) -> Chars:
        ch = self.take()
        return self.escape(in_class=True) if ch == "\\" else _point(ord(ch))


def _digits(s: str) -> bool:
    return s.isascii() and s.isdigit()  # str.isdigit() is also true for '١', which re reads as text


def _point(cp: int) -> Chars:
    return char_set([(cp, cp)])
