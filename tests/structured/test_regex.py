"""Regex specs (llguidance, Rust's regex syntax with \\d \\w \\s as ASCII) against Python's re as the oracle:
the same full matches over random texts, and refusals that say what."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from moeserve.structured.errors import PatternError
from moeserve.structured.params import StructuredOutputsParams as SO, compile_params

PATTERNS = [r"a|b+c*", r"(ab|a)*b?", r"[a-c]{2,4}x", r"\d+(\.\d+)?", r"[^ab]*", r"(?:a|bc){0,3}$", r"^x.y",
            r"[\w-]+@[a-z]+\.com", r"é+|ü?", r"[α-ω]{1,2}", r"\u00e9\x41", r"(a|)+", r"a{3}", r"[-a]b", r"[a-]b",
            r"[]a]", r"\S\s\W", r"(?P<word>[a-c]+)\.", r"a{2,}?b", r"[^\n]+", r"(é|α|1){1,3}-", r"a|b$", r"[\d.é]+",
            r".{0,2}", r"^ab$|^c$", r"(?i)a", r"a++", r"[\D]+", r"[a\S]{1,3}", r"[\W\d]+"]
ALPHABET = "abcx.y1-@éüαβω Aé\n{١\u00a0"  # with a non-ASCII digit and space: \d \s are ASCII


def fullmatch(pattern: str, text: str) -> bool:
    return compile_params(SO(regex=pattern)).fullmatch(text.encode())


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=7))
def test_full_match_equals_python_re(pattern, text):
    assert fullmatch(pattern, text) == bool(re.fullmatch(pattern, text, re.ASCII))


def test_a_character_split_across_tokens_is_a_live_prefix():
    g = compile_params(SO(regex="é|ab"))
    assert g.fullmatch("é".encode()) and not g.fullmatch("é".encode()[:1]) and not g.fullmatch(b"b")


@pytest.mark.parametrize("pattern,words", [
    (r"(a)\1", "backreferences are not supported"), (r"(?=a)", "look-around"), (r"\bword", "lookarounds"),
    (r"a{5,2}", "start must be <= the end"), (r"(ab", "unclosed group"), (r"ab)", "unopened group"),
    (r"[ab", "unclosed character class"), (r"*a", "repetition operator missing expression"),
    (r"a^b", "lookarounds"), (r"\x4", "incomplete escape"), (r"x{", "unclosed counted repetition"),
    # Python reads \012 as octal and a{,3} as a{0,3}; JSON Schema reads a{,3} as text: refused, never guessed
    (r"\012", "backreferences"), (r"a{,3}", "valid decimal"), (r"\Aa\Z", "unrecognized escape"),
    ("(" * 51 + "a" + ")" * 51, "nested more than 50"),
    (r"[^\s\S]", "the regex matches no text"), (r"a[^\s\S]", "matches no text"),
])
def test_refusals_say_what(pattern, words):
    with pytest.raises(PatternError, match=re.escape(words)):
        compile_params(SO(regex=pattern))


def test_rust_reads_posix_classes():
    # Python's re reads [[:alpha:]] as the class "[:alph" then "]"; Rust (llguidance) as a POSIX class
    assert fullmatch(r"[[:alpha:]]+", "abC") and not fullmatch(r"[[:alpha:]]+", "a1")
