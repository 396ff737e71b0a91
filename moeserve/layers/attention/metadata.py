"""Per-forward attention state, set by the model runner in a scoped context (no module globals).

Tokens of all scheduled sequences are flattened into one [T] batch. Sequences whose step is a single new
token (decode) are attended in one batched absorbed-MLA call; multi-token steps (prefill chunks, recompute)
use the decompressed form, one sequence at a time.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    q_start: int  # first row of this sequence in the flat token batch
    q_len: int
    ctx_len: int  # tokens in the cache after this step (prior context + q_len)
    slots: torch.Tensor  # [ctx_len] flat cache slots of the whole context


@dataclass
class DecodeBatch:
    rows: torch.Tensor  # [B] rows of the flat batch holding the decode tokens
    block_table: torch.Tensor  # [B, max_blocks] padded with block 0
    ctx_lens: torch.Tensor  # [B] tokens to attend, including the new one
    mask: torch.Tensor  # [B, max_blocks * block_size] True where a slot is past ctx_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's KV is written to
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    kv_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_lora + rope]


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata):
    global _current
    prev, _current = _current, meta
    try:
        yield meta
    finally:
        _current = prev


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention layers run inside attention_context(...)"
    return _current
