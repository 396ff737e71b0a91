"""Per-forward attention state, set by the model runner in a scoped context (no module globals).

Tokens of all scheduled sequences are flattened into one [T] batch. Sequences whose step is a few new tokens
after some context (decode, MTP verification of [last token + k drafts]) are attended in one batched
absorbed-MLA call, one row per query token, each with its own causal context length; longer steps (prefill
chunks, recompute) use the decompressed form, one sequence at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.scoped import Scoped


ABSORBED_MAX_QUERY = 9  # queries per sequence still sent down the absorbed path (1 + max drafts)


@dataclass
class SeqSpan:
    """One sequence's part of a forward: num_tokens new tokens at positions start.. (their KV is written)."""

    start: int
    num_tokens: int
    block_ids: list[int]


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
    pad_slots: torch.Tensor  # [P] flat positions in [B * max_blocks * block_size] where mask is True
    _context: dict = field(default_factory=dict, repr=False)

    def context_buffer(self, dtype: torch.dtype, row_width: int, device: torch.device) -> torch.Tensor:
        """[B * max_blocks, row_width] scratch for the gathered contexts, made once per step and reused by every
        layer (each layer's attention is done with it before the next gathers). A fresh tensor per layer costs
        more than the copy once it is large: above glibc's mmap threshold (32 MB) every allocation maps new
        pages and faults them in (measured: 27 ms to gather 37.7 MB, batch 32 x 1024 context, 0.8 ms reused)."""
        key = (dtype, row_width, device)
        if key not in self._context:
            self._context[key] = torch.empty(self.block_table.numel(), row_width, dtype=dtype, device=device)
        return self._context[key]

    def per_step(self, key, make):
        """make() once per step, the result shared by every layer (mla_kernel.py's index tensors)."""
        if key not in self._context:
            self._context[key] = make()
        return self._context[key]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's KV is written to
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    kv_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_lora + rope]


def build_attention_metadata(spans: list[SeqSpan], block_size: int,
                             kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and the metadata of a flat batch holding spans back to back (in order)."""
    pos, slots, prefills = [], [], []
    dec_rows, dec_tables, dec_lens = [], [], []
    row = 0
    for sp in spans:
        end = sp.start + sp.num_tokens
        blocks = torch.tensor(sp.block_ids, dtype=torch.long)
        p = torch.arange(sp.start, end)
        pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        if sp.start > 0 and sp.num_tokens <= ABSORBED_MAX_QUERY:
            table = sp.block_ids[: -(-end // block_size)]
            for j in range(sp.num_tokens):  # query j sees positions < start + j + 1 (causal)
                dec_rows.append(row + j)
                dec_tables.append(table)
                dec_lens.append(sp.start + j + 1)
        else:
            ctx = torch.arange(end)
            prefills.append(PrefillSeq(row, sp.num_tokens, end, blocks[ctx // block_size] * block_size
                                       + ctx % block_size))
        row += sp.num_tokens
    decode = _decode_batch(dec_rows, dec_tables, dec_lens, block_size)
    positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
    slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    return positions, AttentionMetadata(slot_mapping, prefills, decode, kv_caches)


def _decode_batch(rows: list[int], tables: list[list[int]], lens: list[int], block_size: int) -> DecodeBatch | None:
    if not rows:
        return None
    width = max(len(t) for t in tables)
    table = torch.zeros(len(rows), width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    ctx = torch.tensor(lens)
    mask = torch.arange(width * block_size)[None, :] >= ctx[:, None]
    return DecodeBatch(torch.tensor(rows), table, ctx, mask, mask.view(-1).nonzero().squeeze(1))


_CURRENT: Scoped[AttentionMetadata] = Scoped("attention_metadata")


def attention_context(meta: AttentionMetadata):
    return _CURRENT.use(meta)


def get_attention_metadata() -> AttentionMetadata:
    meta = _CURRENT.get()
    assert meta is not None, "attention layers run inside attention_context(...)"
    return meta
