"""The regex parser and byte DFA against Python's re (the oracle), and UTF-8 range splitting."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from moeserve.structured.automaton import compile_dfa, utf8_ranges
from moeserve.structured.regex import PatternError, parse

PATTERNS = [r"a|b+c*", r"(ab|a)*b?", r"[a-c]{2,4}x", r"\d+(\.\d+)?", r"[^ab]*", r"(?:a|bc){0,3}$", r"^x.y",
            r"[\w-]+@[a-z]+\.com", r"é+|ü?", r"[α-ω]{1,2}", r"\u00e9\x41", r"(a|)+", r"a{3}", r"[-a]b", r"[a-]b",
            r"[]a]", r"\S\s\W", r"(?P<word>[a-c]+)\.", r"a{2,}?b", r"x{", r"[^\n]+", r"(é|α|1){1,3}-", r"\A[ab]\Z",
            r"a|b$", r"[\d.é]+", r".{0,2}"]
ALPHABET = "abcx.y1-@éüαβω Aé\n{"


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=7))
def test_dfa_full_match_equals_python_re(pattern, text):
    dfa = compile_dfa(parse(pattern))
    assert dfa.fullmatch(text.encode()) == bool(re.fullmatch(pattern, text, re.ASCII))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 0x10FFFF), st.integers(0, 0x10FFFF), st.lists(st.integers(0, 0x10FFFF), max_size=50))
def test_utf8_ranges_cover_exactly_the_code_points(a, b, probes):
    lo, hi = min(a, b), max(a, b)
    seqs = utf8_ranges(lo, hi)
    for cp in probes + [lo, hi, max(lo - 1, 0), min(hi + 1, 0x10FFFF)]:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        enc = chr(cp).encode("utf-8")
        hit = any(len(s) == len(enc) and all(x <= c <= y for c, (x, y) in zip(enc, s)) for s in seqs)
        assert hit == (lo <= cp <= hi), (lo, hi, cp)


def test_partial_utf8_is_a_live_state_and_dead_states_are_pruned():
    dfa = compile_dfa(parse("é|ab"))
    half = dfa.step(1, "é".encode()[:1])
    assert half and not dfa.accepting[half]  # a token may end inside a character
    assert dfa.step(1, b"b") == 0
    assert dfa.fullmatch("é".encode()) and not dfa.can_continue(dfa.step(1, "é".encode()))


@pytest.mark.parametrize("pattern,words", [
    (r"(a)\1", "back-references"), (r"(?=a)", "look-around"), (r"\bword", "word boundaries"),
    (r"a++", "possessive"), (r"(?i)a", "flags"), (r"a{5,2}", "max < min"), (r"a{99999}", "above"),
    (r"(ab", "missing ')'"), (r"ab)", "unbalanced"), (r"[ab", "missing ']'"), (r"*a", "nothing to repeat"),
    (r"a^b", "anchor"), (r"(\w+\s?){1,500}", "too complex to compile"), (r".{9000}", "too complex"), (r"[[:alpha:]]", "POSIX"), (r"\x4", "hex digits"), (r"[^\s\S]", "matches no string"),
])
def test_refusals_say_what(pattern, words):
    with pytest.raises(PatternError, match=re.escape(words)):
        compile_dfa(parse(pattern))


@pytest.mark.parametrize("pattern,texts", [
    (r"\012|\0", ["\n", "\x00", "\x0012"]),  # Python's octal escapes, not NUL then digits
    (r"[\0-\07]+\08", ["\x07\x00\x008", "\x01\x008"]),
    (r"^ab$|^c$", ["ab", "c", "abc"]),  # an anchor at every top-level alternative
    (r"\Aa|\Ab\Z", ["a", "b"]),
    (r"a{١}", ["a{١}", "a"]),  # non-ASCII digits are text in re, not a repeat count
])
def test_tricky_syntax_matches_python_re(pattern, texts):
    dfa = compile_dfa(parse(pattern))
    for text in texts:
        assert dfa.fullmatch(text.encode()) == bool(re.fullmatch(pattern, text, re.ASCII)), text


def test_open_lower_bound_repeat_is_refused():
    # Python reads a{,3} as a{0,3}, JSON Schema (ECMA-262) as the text "a{,3}": neither reading is safe
    with pytest.raises(PatternError, match=re.escape("write {0,3}")):
        parse(r"a{,3}")
