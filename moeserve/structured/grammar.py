"""The engine's side of structured output: the vocabulary's bytes, one llguidance matcher per request
(structured/matcher.py) and the batch's masks applied to the logits rows (MTP drafts included).

The grammar arrives checked with the request (EngineCoreRequest.structured_grammar); the engine builds llguidance's
matcher from it once per grammar and copies it per request. Stop tokens (EOS, stop_token_ids) are allowed only
where the output so far matches the whole pattern.
"""
from __future__ import annotations

import json
from collections import OrderedDict

import torch

from moeserve.structured.params import StructuredOutputsParams, compile_params

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


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple], errors: dict[int, str] | None = None) -> None:
    """In place: logits [sum rows, V]; rows = (matcher or None, output_ids, draft_ids, end_ids, fallback_ids)
    per request (see GuidanceMatcher.row_masks). A request whose mask fails gets its message in errors[i]
    (its rows are left as they were; without errors the exception propagates)."""
    from moeserve.structured.matcher import prefetch_masks
    guided = [(m, out) for m, out, *_ in rows if m is not None]
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
    """The engine's side: llguidance's view of the vocabulary (built on the first structured request) and the
    checked grammars it was sent, by spec."""

    def __init__(self, tokenizer_path: str, vocab_size: int, tokenizer=None) -> None:
        self.tokenizer_path, self.vocab_size, self._tokenizer = tokenizer_path, vocab_size, tokenizer
        self._guidance = None  # llguidance's view of the tokenizer (structured/guidance.py), built on first use
        self._checked: OrderedDict[tuple, object] = OrderedDict()  # spec -> GuidanceGrammar as sent

    def tokenizer(self):
        if self._tokenizer is None:
            from moeserve.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams, compiled: bytes | None = None):
        """The request's GuidanceMatcher; compiled: what the builder sent (GuidanceGrammar.to_bytes), loaded
        when this spec is not held here (without it the spec is compiled, which only processes that may
        compile do)."""
        from moeserve.structured import guidance, matcher
        key = params.key
        held = self._checked.get(key)
        if held is None or compiled is not None and held.to_bytes() != compiled:
            held = guidance.GuidanceGrammar.from_bytes(compiled) if compiled is not None else compile_params(params)
        self._checked[key] = held
        self._checked.move_to_end(key)
        if len(self._checked) > 64:
            self._checked.popitem(last=False)
        if self._guidance is None:
            tok = self.tokenizer()
            self._guidance = matcher.GuidanceVocab.from_hf(tok, token_bytes(tok, self.vocab_size))
        return matcher.GuidanceMatcher(self._guidance, held,
                                       params.after.encode("utf-8") if params.after else None)
