"""KV-cache storage dtype: the model dtype, or FP8 e4m3 with --kv-cache-dtype fp8 (half BF16's bytes).

Writers go through write_cache, readers through gather_cache, which upcasts to the compute dtype. The FP8
tensors are the cache itself (what PD disaggregation registers with NIXL and transfers, byte for byte).
"""
from __future__ import annotations

import torch

FP8_KV_MAX = 448.0  # largest finite e4m3fn


def to_cache_dtype(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New cache rows in the cache's dtype. FP8 (--kv-cache-dtype fp8): one per-tensor scale of 1.0, as vLLM
    uses without calibrated scales (the latent is RMS-normed, O(1)); clamped, since a cast beyond e4m3's range
    gives NaN. Readers upcast with .to(), which is exact for e4m3."""
    if dtype == torch.float8_e4m3fn:
        return kv.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return kv.to(dtype)


def gather_cache(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] upcast to dtype. CPU indexing has no FP8 kernels: FP8 rows are gathered as bytes."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index].view(cache.dtype).to(dtype)
    return cache[index].to(dtype)


def gather_decode_context(cache: torch.Tensor, d, dtype: torch.dtype) -> torch.Tensor:
    """Each decode sequence's context [B, L, C + dr] from its block table, upcast to dtype, in the step's
    scratch buffer (DecodeBatch.context_buffer: valid until the next layer gathers). Slots past a sequence's
    length hold whatever their block held before (a failed request's NaN included); a zero probability times
    NaN is NaN, so they are cleared, not only masked: by their flat positions (index_fill_, computed once per
    step), 20x faster on CPU than a masked_fill broadcasting the [B, L] mask over C + dr."""
    b, width = d.block_table.shape[0], cache.shape[-1]
    blocks = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * (C + dr)]: one row per block
    out = d.context_buffer(dtype, blocks.shape[1], cache.device)
    index = d.block_table.view(-1)
    if cache.dtype == dtype:
        torch.index_select(blocks, 0, index, out=out)
    else:  # gathered in the cache's dtype (FP8 as bytes: CPU indexing has no FP8 kernels), then upcast
        raw = blocks.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else blocks
        staged = d.context_buffer(raw.dtype, raw.shape[1], cache.device)
        torch.index_select(raw, 0, index, out=staged)
        out.copy_(staged.view(cache.dtype))
    out.view(-1, width).index_fill_(0, d.pad_slots, 0)
    return out.view(b, -1, width)


def read_block_columns(cache: torch.Tensor, block_table: torch.Tensor, first: int, count: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Block columns [first, first + count) of every decode row's block table, straight from the paged cache
    [num_blocks, block_size, C + dr]: [B, count * block_size, C + dr] in dtype, a small transient tile (a
    block-wise reader's working set, not the row's whole context). Stale slots come as they are stored."""
    ids = block_table[:, first:first + count].reshape(-1)
    if cache.dtype == torch.float8_e4m3fn:  # indexed as bytes (CPU indexing has no FP8 kernels), then upcast
        tile = cache.view(torch.uint8).index_select(0, ids).view(cache.dtype).to(dtype)
    else:
        tile = cache.index_select(0, ids).to(dtype)
    return tile.view(block_table.shape[0], -1, cache.shape[-1])


def write_cache(flat_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    rows = to_cache_dtype(rows, flat_cache.dtype)
    if flat_cache.dtype == torch.float8_e4m3fn:  # no FP8 index_copy_ on CPU: copy the bytes
        flat_cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, rows)
