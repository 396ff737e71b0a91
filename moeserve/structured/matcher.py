"""Structured output on llguidance: the engine's side. One llguidance matcher per request over the engine's
tokenizer (GuidanceMatcher), built from the checked grammar the request carries (structured/guidance.py).

llguidance has no ahead-of-time token-level compile: the matcher is built lazily from the grammar and each
step's mask is computed from the parser state (Earley parser + lazily built lexer DFA), bounded per token by
guidance.LIMITS' step fuel. The matcher's position is derived from the request's output tokens: drafts are
consumed and rolled back, a preempted request (fewer output tokens) starts again.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from moeserve.markers import partial_marker_len
from moeserve.structured.errors import PatternError
from moeserve.structured.guidance import GuidanceGrammar, limits


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
