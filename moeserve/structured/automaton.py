"""Regex AST -> a deterministic automaton over UTF-8 bytes.

Tokens are byte strings (byte-level BPE splits characters), so the automaton reads bytes: character sets
become alternatives of byte-range sequences (the UTF-8 encoding of each code-point range), a Thompson NFA
is built from the AST and made deterministic by subset construction over byte classes (bytes the pattern
never tells apart share one class). State 0 is the dead state, state 1 the start.
"""
from __future__ import annotations

import functools
import itertools
import struct
import sys
from array import array

import numpy as np
import torch

from moeserve.structured.regex import Alt, Chars, OrderedSubset, PatternError, Repeat, Seq, char_set

MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 50_000
# Subset construction's inner-loop steps (moves and closures): a pattern whose DFA states are huge NFA sets ((\w+\s?){1,500})
# would otherwise take minutes before it reached MAX_DFA_STATES; this bounds a compile to a few seconds.
MAX_WORK = 10_000_000
# States x byte classes of the table (int32 entries): 4M entries is 16 MB per automaton, on the wire to the
# engine with every request that uses it and in the engine's cache.
MAX_TABLE_ENTRIES = 4_000_000
_UTF8_LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)


def utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Code points [lo, hi] -> byte-range sequences whose byte strings are exactly the UTF-8 encodings of
    its non-surrogate code points."""
    out: list[list[tuple[int, int]]] = []
    for lo_part, hi_part in char_set([(lo, hi)]).ranges:
        start = 0
        for limit in _UTF8_LENGTH_LIMITS:  # one encoded length at a time
            a, b = max(lo_part, start), min(hi_part, limit)
            if a <= b:
                _split_same_length(a, b, out)
            start = limit + 1
    return out


def _split_same_length(lo: int, hi: int, out: list) -> None:
    # Split until every continuation byte below the first differing one spans its full range 80..BF;
    # then each byte position is an independent range.
    n = len(chr(lo).encode("utf-8"))
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _split_same_length(lo, lo | m, out)
                _split_same_length((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split_same_length(lo, (hi & ~m) - 1, out)
                _split_same_length(hi & ~m, hi, out)
                return
    a, b = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    out.append(list(zip(a, b)))


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []  # (byte lo, byte hi, target)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise PatternError(f"the pattern is too large (more than {MAX_NFA_STATES} automaton states); "
                               "lower its repeat counts or lengths")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """A fresh fragment (entry, exit) for node."""
        if isinstance(node, Chars):
            s, e = self.state(), self.state()
            for lo, hi in node.ranges:
                for seq in utf8_ranges(lo, hi):
                    cur = s
                    for j, (b_lo, b_hi) in enumerate(seq):
                        nxt = e if j == len(seq) - 1 else self.state()
                        self.edges[cur].append((b_lo, b_hi, nxt))
                        cur = nxt
            return s, e
        if isinstance(node, Seq):
            s = e = self.state()
            for item in node.items:
                a, b = self.build(item)
                self.eps[e].append(a)
                e = b
            return s, e
        if isinstance(node, Alt):
            s, e = self.state(), self.state()
            for item in node.items:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if isinstance(node, Repeat):
            s = e = self.state()
            for _ in range(node.lo):
                a, b = self.build(node.item)
                self.eps[e].append(a)
                e = b
            end = self.state()
            self.eps[e].append(end)
            if node.hi is None:  # a loop: exit <- item <- exit
                a, b = self.build(node.item)
                self.eps[e].append(a)
                self.eps[b].append(e)
            else:  # up to hi - lo more, each optional: every copy's entry may jump to the end
                for _ in range(node.hi - node.lo):
                    a, b = self.build(node.item)
                    self.eps[e].append(a)
                    self.eps[b].append(end)
                    e = b
            return s, end
        if isinstance(node, OrderedSubset):
            return self._ordered_subset(node)
        raise TypeError(f"not a pattern node: {node!r}")

    def _ordered_subset(self, node: OrderedSubset) -> tuple[int, int]:
        # Back to front: after[i] matches items i.. when one was written already (each starts with the
        # separator), first[i] when none was. Each item is built twice, so the size stays linear.
        end = self.state()
        after = first = end
        for item, required in zip(reversed(node.items), reversed(node.required)):
            sep_in, sep_out = self.build(node.separator)
            a_in, a_out = self.build(item)
            f_in, f_out = self.build(item)
            self.eps[sep_out].append(a_in)
            self.eps[a_out].append(after)
            self.eps[f_out].append(after)
            new_after, new_first = self.state(), self.state()
            self.eps[new_after].append(sep_in)
            self.eps[new_first].append(f_in)
            if not required:
                self.eps[new_after].append(after)
                self.eps[new_first].append(first)
            after, first = new_after, new_first
        return first, end


class DFA:
    """A byte DFA: next state = flat[state * num_classes + byte_class[b]]; state 0 dead, 1 start.

    The table is one flat int32 array, so it crosses processes as bytes (to_bytes / from_bytes: the API
    server compiles, the engine core only loads) and becomes the engine's torch table without a copy."""

    MAGIC = b"MSDFA1"

    def __init__(self, flat: array, num_classes: int, byte_class: bytes, accepting: list[bool]) -> None:
        self.flat, self.num_classes, self.byte_class, self.accepting = flat, num_classes, byte_class, accepting
        self.wire: bytes | None = None  # to_bytes(), kept once a request sent it (structured/params.py)

    @classmethod
    def from_rows(cls, transitions: list[list[int]], byte_class: list[int], accepting: list[bool]) -> "DFA":
        return cls(array("i", itertools.chain.from_iterable(transitions)), len(transitions[0]), bytes(byte_class),
                   list(accepting))

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    @functools.cached_property
    def transitions(self) -> list[list[int]]:
        """transitions[s][c] (built once, on demand: tests and inspection)."""
        c = self.num_classes
        return [list(self.flat[s * c:(s + 1) * c]) for s in range(self.num_states)]

    def step(self, state: int, data: bytes) -> int:
        flat, c, cls = self.flat, self.num_classes, self.byte_class
        for b in data:
            state = flat[state * c + cls[b]]
            if not state:
                return 0
        return state

    def fullmatch(self, data: bytes) -> bool:
        return self.accepting[self.step(1, data)]

    def can_continue(self, state: int) -> bool:
        c = self.num_classes
        return any(self.flat[state * c:(state + 1) * c])

    def byte_table(self) -> torch.Tensor:
        """[num_states, 257] int32: next state on each byte; column 256 (padding) keeps the state."""
        tr = torch.frombuffer(self.flat, dtype=torch.int32).view(self.num_states, self.num_classes)
        table = tr[:, torch.frombuffer(bytearray(self.byte_class), dtype=torch.uint8).long()]
        return torch.cat([table, torch.arange(self.num_states, dtype=torch.int32)[:, None]], dim=1)

    def to_bytes(self) -> bytes:
        """MAGIC, num_states and num_classes (uint32 LE), byte_class [256], accepting [S], table int32 LE."""
        flat = self.flat
        if sys.byteorder == "big":
            flat = array("i", flat)
            flat.byteswap()
        return b"".join((self.MAGIC, struct.pack("<II", self.num_states, self.num_classes), self.byte_class,
                         bytes(self.accepting), flat.tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes) -> "DFA":
        """The inverse of to_bytes, checked (every entry a state, every class in range): ValueError if not."""
        head = len(cls.MAGIC) + 8
        if len(data) < head + 256 or not data.startswith(cls.MAGIC):
            raise ValueError("not a compiled structured-output automaton")
        states, classes = struct.unpack_from("<II", data, len(cls.MAGIC))
        if not (2 <= states and 1 <= classes <= 256 and states * classes <= MAX_TABLE_ENTRIES
                and len(data) == head + 256 + states + 4 * states * classes):
            raise ValueError("a compiled structured-output automaton of the wrong size")
        byte_class = data[head:head + 256]
        accepting = data[head + 256:head + 256 + states]
        table = np.frombuffer(data, dtype="<i4", offset=head + 256 + states)
        if max(byte_class) >= classes or max(accepting) > 1 or table.min() < 0 or table.max() >= states:
            raise ValueError("a compiled structured-output automaton with entries out of range")
        flat = array("i")
        flat.frombytes(table.astype("=i4", copy=False).tobytes())
        return cls(flat, classes, bytes(byte_class), [bool(a) for a in accepting])


def compile_dfa(node) -> DFA:
    """AST -> DFA whose every non-dead state can still reach acceptance. Raises PatternError when the
    pattern matches nothing or is too large."""
    nfa = _NFA()
    start, accept = nfa.build(node)
    cuts = sorted({0, 256} | {x for edges in nfa.edges for lo, hi, _ in edges for x in (lo, hi + 1)})
    byte_class = [0] * 256
    for c, (a, b) in enumerate(zip(cuts, cuts[1:])):
        for x in range(a, b):
            byte_class[x] = c
    num_classes = len(cuts) - 1
    # Each NFA edge covers a contiguous run of classes.
    class_edges = [[(byte_class[lo], byte_class[hi], t) for lo, hi, t in edges] for edges in nfa.edges]

    closure_memo: dict[frozenset, frozenset] = {}
    work = 0

    def closure(states) -> frozenset:
        nonlocal work
        key = frozenset(states)
        if key in closure_memo:
            return closure_memo[key]
        seen, stack = set(key), list(key)
        work += len(key)
        while stack:
            work += 1
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        # Keep only states with byte edges (or the accept state): the rest add nothing after closure.
        result = frozenset(s for s in seen if nfa.edges[s] or s == accept)
        closure_memo[key] = result
        return result

    ids: dict[frozenset, int] = {frozenset(): 0}
    sets = [frozenset()]
    transitions: list[list[int]] = [[0] * num_classes]
    first = closure([start])
    ids[first] = 1
    sets.append(first)
    transitions.append([])
    todo = [1]
    while todo:
        sid = todo.pop()
        moves: list[set] = [set() for _ in range(num_classes)]
        for s in sets[sid]:
            for c_lo, c_hi, t in class_edges[s]:
                work += c_hi - c_lo + 1
                for c in range(c_lo, c_hi + 1):
                    moves[c].add(t)
        if work > MAX_WORK:
            raise PatternError("the pattern is too complex to compile (its automaton does too much work per "
                               "state); simplify it, e.g. with fewer nested or overlapping repeats")
        row = []
        for targets in moves:
            if not targets:
                row.append(0)
                continue
            nxt = closure(targets)
            if nxt not in ids:
                if len(sets) >= MAX_DFA_STATES:
                    raise PatternError(f"the pattern is too complex (more than {MAX_DFA_STATES} automaton "
                                       "states); lower its repeat counts or lengths (maxLength, maxItems)")
                ids[nxt] = len(sets)
                sets.append(nxt)
                transitions.append([])
                todo.append(ids[nxt])
            row.append(ids[nxt])
        transitions[sid] = row
    accepting = [accept in s for s in sets]
    if len(sets) * num_classes > MAX_TABLE_ENTRIES:
        raise PatternError(f"the pattern's automaton is too large ({len(sets)} states x {num_classes} byte "
                           f"classes, more than {MAX_TABLE_ENTRIES} entries); simplify it")
    return _prune(transitions, byte_class, accepting)


def _prune(transitions: list[list[int]], byte_class: list[int], accepting: list[bool]) -> DFA:
    """Send transitions into states that cannot reach acceptance to the dead state."""
    n = len(transitions)
    back: list[list[int]] = [[] for _ in range(n)]
    for s, row in enumerate(transitions):
        for t in set(row):
            back[t].append(s)
    live = [False] * n
    stack = [s for s in range(n) if accepting[s]]
    for s in stack:
        live[s] = True
    while stack:
        for p in back[stack.pop()]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    if not live[1]:
        raise PatternError("the pattern matches no string")
    live[0] = False
    return DFA.from_rows([[t if live[t] else 0 for t in row] for row in transitions], byte_class, accepting)
