"""Token masks from a byte DFA: which vocabulary entries may come next, per request and per logits row.

A token is allowed in DFA state s when reading all its bytes from s ends in a live state. The vocabulary's
byte strings are stored by column (tokens sorted longest first, column t holds byte t of the tokens longer
than t), so one state's mask over the whole vocabulary is one gather per byte position. Masks are cached
per state: a schema's output revisits few states. The stop tokens (EOS, stop_token_ids) are allowed only
where the output so far matches the whole pattern.
"""
from __future__ import annotations

import itertools
import json
from collections import OrderedDict

import torch

from moeserve.markers import partial_marker_len
from moeserve.structured.automaton import DFA
from moeserve.structured.params import StructuredOutputsParams, compile_params

MASK_CACHE_BYTES = 256 << 20  # per vocabulary, all grammars together: masks are vocab-size bools


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE writes byte b as one printable character: printable Latin-1 bytes as
    themselves, the other 68 bytes as U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(0x100 + extra)] = b
            extra += 1
    return out


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes as it appears in generated text; None for special tokens and ids the
    tokenizer lacks (the model's vocabulary is often padded)."""
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    byte_level = "ByteLevel" in kinds
    alphabet = _byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    out: list[bytes | None] = [None] * vocab_size
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    for i, piece in enumerate(pieces):
        if piece is None or i in special or (i in added and added[i].special):
            continue
        if i in added:  # added tokens are stored as text
            out[i] = added[i].content.encode("utf-8")
        elif byte_level:
            if all(ch in alphabet for ch in piece):
                out[i] = bytes(alphabet[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode("utf-8")
    return out


class TokenTable:
    """The vocabulary's bytes laid out for batched DFA runs."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.vocab_size = len(pieces)
        self.pieces = pieces
        valid = sorted((i for i, p in enumerate(pieces) if p), key=lambda i: -len(pieces[i]))
        self.order = torch.tensor(valid, dtype=torch.int64)
        longest = len(pieces[valid[0]]) if valid else 0
        self.columns = []
        n = len(valid)
        for t in range(longest):
            while n and len(pieces[valid[n - 1]]) <= t:  # lengths descend: drop the tokens that ended
                n -= 1
            self.columns.append(torch.tensor([pieces[i][t] for i in valid[:n]], dtype=torch.int64))


class MaskCache:
    """Token masks of the grammars of one vocabulary, least recently used dropped past MASK_CACHE_BYTES in
    all (a budget per grammar, with 16 grammars kept, would let the masks grow to 4 GiB)."""

    def __init__(self, vocab_size: int) -> None:
        self.masks: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self.max_masks = max(16, MASK_CACHE_BYTES // max(1, vocab_size))

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        mask = self.masks.get(key)
        if mask is not None:
            self.masks.move_to_end(key)
        return mask

    def put(self, key: tuple[int, int], mask: torch.Tensor) -> None:
        self.masks[key] = mask
        while len(self.masks) > self.max_masks:
            self.masks.popitem(last=False)


_grammar_ids = itertools.count()


class TokenGrammar:
    """One compiled pattern over one vocabulary: per-state token masks, cached (in `cache`, shared by the
    engine's grammars)."""

    def __init__(self, dfa: DFA, table: TokenTable, cache: MaskCache | None = None) -> None:
        self.dfa, self.table = dfa, table
        self.flat = dfa.byte_table()[:, :256].contiguous().view(-1)
        self.cache = cache if cache is not None else MaskCache(table.vocab_size)
        self.uid = next(_grammar_ids)  # the cache's key, with the state
        self.thinking: dict[tuple[bytes, bytes], torch.Tensor | None] = {}  # at most len(marker) entries each

    def allowed(self, state: int) -> torch.Tensor:
        """bool [vocab]: tokens that keep the output matchable from `state` (stop tokens not included)."""
        mask = self.cache.get((self.uid, state))
        if mask is not None:
            return mask
        mask = torch.zeros(self.table.vocab_size, dtype=torch.bool)
        if state:
            cur = torch.full((len(self.table.order),), state, dtype=torch.int64)
            for col in self.table.columns:
                k = len(col)
                cur[:k] = self.flat[cur[:k] * 256 + col]
            mask[self.table.order] = cur != 0
        self.cache.put((self.uid, state), mask)
        return mask

    def ends_match(self, state: int, token_id: int) -> bool:
        """Whether ending the output with stop token `token_id` (its text kept, if it has any) leaves a match."""
        piece = self.table.pieces[token_id]
        return self.dfa.accepting[self.dfa.step(state, piece) if piece else state]

    def advance(self, state: int, token_id: int) -> int:
        piece = self.table.pieces[token_id] if 0 <= token_id < self.table.vocab_size else None
        return self.dfa.step(state, piece) if piece else 0

    def thinking_mask(self, marker: bytes, matched: bytes) -> torch.Tensor | None:
        """Before the marker: every token, except those that complete it with bytes the pattern cannot
        start with (None when there are none). Cached per matched prefix of the marker."""
        key = (marker, matched)
        if key not in self.thinking:
            mask = torch.ones(self.table.vocab_size, dtype=torch.bool)
            bad = [t for t, p in enumerate(self.table.pieces)
                   if p and (marker in p or (matched and (matched + p).find(marker) >= 0))
                   and _after_marker(marker, matched + p, self.dfa) == 0]
            mask[bad] = False
            self.thinking[key] = mask if bad else None
        return self.thinking[key]


def _after_marker(marker: bytes, text: bytes, dfa: DFA) -> int | bytes:
    """The position after `text` (the marker's matched prefix + a token's bytes): the DFA state after the
    marker once it is complete, else the longest end of text that begins the marker."""
    cut = text.find(marker)
    if cut >= 0:
        return dfa.step(1, text[cut + len(marker):])
    k = partial_marker_len(text, marker)
    return text[len(text) - k:] if k else b""


class GrammarMatcher:
    """One request's position in its grammar, derived from its output tokens (so a preempted and
    recomputed request, or one whose drafts were rejected, needs no rollback).

    With `after` (a reasoning model's end of thinking, b"</think>"), the output is free until that text
    appears and the pattern applies to what follows it. Until then the position is the text's last bytes
    (bytes, enough to find the marker across tokens); after it, a DFA state (int)."""

    def __init__(self, grammar: TokenGrammar, after: bytes | None = None) -> None:
        self.grammar, self.after = grammar, after
        self.start: int | bytes = b"" if after else 1
        self.state, self.consumed = self.start, 0

    def advance(self, state: int | bytes, token_id: int) -> int | bytes:
        g = self.grammar
        if isinstance(state, int):  # a stop token ends the output; anything else must follow the grammar
            return g.advance(state, token_id) if state else 0
        piece = g.table.pieces[token_id] if 0 <= token_id < g.table.vocab_size else None
        return _after_marker(self.after, state + (piece or b""), g.dfa)

    def sync(self, output_ids: list[int]) -> int | bytes:
        if len(output_ids) < self.consumed:
            self.state, self.consumed = self.start, 0
        for t in output_ids[self.consumed:]:
            self.state = self.advance(self.state, t)
        self.consumed = len(output_ids)
        return self.state

    def row_masks(self, output_ids: list[int], draft_ids: list[int], end_ids: list[int],
                  fallback_ids: list[int] = ()) -> torch.Tensor | None:
        """bool [len(draft_ids) + 1, vocab]: row j may follow output + drafts[:j]. end_ids (the request's
        stop tokens) are allowed where they leave a match: a special one (EOS) where the output matches, one
        with text (a stop_token_ids entry; its text stays in the output) where output + its text does.
        fallback_ids (EOS) only where nothing else is (ignore_eos past the pattern's end). Rows after a
        draft the grammar forbids repeat the row before (that draft is rejected, so they are never used).
        None: no row is constrained yet (thinking)."""
        g = self.grammar
        ends = [t for t in end_ids if t < g.table.vocab_size]
        state = self.sync(output_ids)
        rows: list[torch.Tensor | None] = []
        for j in range(len(draft_ids) + 1):
            if isinstance(state, bytes):  # still thinking: anything that does not end it badly
                rows.append(g.thinking_mask(self.after, state))
            elif j and not state:
                rows.append(rows[-1])
            else:
                mask = g.allowed(state)
                if ends:
                    mask = mask.clone()
                    mask[ends] = torch.tensor([not state or g.ends_match(state, t) for t in ends])
                if not bool(mask.any()):  # the pattern is complete (ignore_eos), or no token has the next byte
                    mask = mask.clone()
                    mask[[t for t in fallback_ids if t < g.table.vocab_size]] = True
                rows.append(mask)
            if j < len(draft_ids):
                state = self.advance(state, draft_ids[j])
        if all(r is None for r in rows):
            return None
        free = torch.ones(g.table.vocab_size, dtype=torch.bool)
        return torch.stack([free if r is None else r for r in rows])


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple], errors: dict[int, str] | None = None) -> None:
    """In place: logits [sum rows, V]; rows = (matcher or None, output_ids, draft_ids, end_ids, fallback_ids)
    per request (see GrammarMatcher.row_masks). A request whose mask fails gets its message in errors[i]
    (its rows are left as they were; without errors the exception propagates)."""
    from moeserve.structured.guidance import GuidanceMatcher, prefetch_masks
    guided = [(m, out) for m, out, *_ in rows if isinstance(m, GuidanceMatcher)]
    if len(guided) > 1:
        try:
            prefetch_masks(guided)
        except Exception:  # noqa: BLE001 - each request's row_masks below computes (and reports) its own
            pass
    r = 0
    for i, (matcher, output_ids, draft_ids, end_ids, fallback_ids) in enumerate(rows):
        n = len(draft_ids) + 1
        try:
            mask = matcher.row_masks(output_ids, draft_ids, end_ids, fallback_ids) if matcher is not None else None
        except Exception as e:  # noqa: BLE001 - one request's grammar must not end the step of the others
            if errors is None:
                raise
            errors[i] = f"structured output failed: {type(e).__name__}: {e}"
            mask = None
        if mask is not None:
            block = logits[r:r + n]  # the table spans the model's whole vocabulary
            # The grammar's mask is intersected with what the request's own masks left (allowed_token_ids,
            # bad_words, min_tokens' stop tokens: -inf already), never replacing them.
            block.masked_fill_(~mask, float("-inf"))
            # min_tokens (or allowed_token_ids) masked the stop tokens and nothing else the grammar allows is
            # left: the output matches, so its stop tokens end it as a match (a row of -inf would sample
            # garbage, or raise; Request.check_stop lets a structured request stop before min_tokens). Only
            # stop tokens come back: a row where allowed_token_ids or bad_words leave no token the grammar
            # allows stays empty, and the request fails (nothing can be sampled) instead of ignoring them.
            stuck = torch.isneginf(block).all(-1) & mask.any(-1)
            if bool(stuck.any()):
                stops = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
                stops[[t for t in (*end_ids, *fallback_ids) if 0 <= t < mask.shape[-1]]] = True
                rescue = mask[stuck] & stops
                block[stuck] = torch.zeros((), dtype=block.dtype).masked_fill(~rescue, float("-inf"))
        r += n


class StructuredOutputManager:
    """The engine's side: the vocabulary's bytes (loaded on the first structured request) and one
    TokenGrammar per distinct spec."""

    def __init__(self, tokenizer_path: str, vocab_size: int, tokenizer=None) -> None:
        self.tokenizer_path, self.vocab_size, self._tokenizer = tokenizer_path, vocab_size, tokenizer
        self._table: TokenTable | None = None
        self._masks: MaskCache | None = None
        self._grammars: OrderedDict[tuple, TokenGrammar] = OrderedDict()
        self._tok = tokenizer
        self._guidance = None  # llguidance's view of the tokenizer (structured/guidance.py), built on first use
        self._checked: OrderedDict[tuple, object] = OrderedDict()  # spec -> GuidanceGrammar as sent

    def table(self) -> TokenTable:
        if self._table is None:
            tok = self.tokenizer()
            self._table = TokenTable(token_bytes(tok, self.vocab_size))
            self._masks = MaskCache(self._table.vocab_size)
        return self._table

    def tokenizer(self):
        if self._tokenizer is None:
            from moeserve.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams, compiled: bytes | None = None):
        """The request's matcher (a GrammarMatcher, or a GuidanceMatcher for an llguidance grammar);
        compiled: what the builder sent (DFA.to_bytes or GuidanceGrammar.to_bytes), loaded when this spec is
        not cached here (without it the spec is compiled, which only processes that may compile do)."""
        from moeserve.structured import guidance
        after = params.after.encode("utf-8") if params.after else None
        key = params.key
        dfa = None
        if compiled is not None and compiled.startswith(guidance.WIRE_MAGIC) or \
                compiled is None and key not in self._grammars:
            held = self._checked.get(key)
            if held is None or compiled is not None and held.to_bytes() != compiled:
                held = guidance.GuidanceGrammar.from_bytes(compiled) if compiled is not None \
                    else compile_params(params)
            if isinstance(held, guidance.GuidanceGrammar):
                self._checked[key] = held
                self._checked.move_to_end(key)
                if len(self._checked) > 64:
                    self._checked.popitem(last=False)
                if self._guidance is None:
                    self._guidance = guidance.GuidanceVocab.from_hf(self.tokenizer(), self.table().pieces)
                return guidance.GuidanceMatcher(self._guidance, held, after)
            dfa = held  # a DFA: the builtin backend compiled it here (only where that is allowed)
        grammar = self._grammars.get(key)
        if grammar is None:
            dfa = dfa or (DFA.from_bytes(compiled) if compiled is not None else compile_params(params))
            grammar = TokenGrammar(dfa, self.table(), self._masks)
            self._grammars[key] = grammar
            if len(self._grammars) > 16:  # each holds its mask cache
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return GrammarMatcher(grammar, after)
