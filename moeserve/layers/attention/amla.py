"""AMLA: absorbed MLA decode whose online-softmax rescaling is an integer add on the output's exponent bits.

Flash-style decoding walks the latent KV in blocks and keeps, per (sequence, head), a running maximum m,
a running sum l and an unnormalised output O [C]. When a block raises the maximum, O and l must be
multiplied by exp(m_old - m_new): a full read-multiply-write of O for every block. AMLA (Huawei's MLA
decode for Ascend) keeps the maximum in base 2 and rounded up to an integer, so the factor is 2^k with an
integer k <= 0, and multiplying a float by 2^k is adding k to its exponent field: O's bits (viewed as
int32) get k << 23 added in place, with no float multiply (and, in the paper's kernel, no move of O out of
its buffer). Scores become p = 2^(s * log2(e) - m), exact softmax weights up to rounding: p <= 1 because m
>= every scaled score.

Two guards keep the integer add exact where the float multiply would be: zeros (an output row no block
has reached, or exact cancellation) stay zero, and an entry whose exponent would drop to zero or below
(a denormal: magnitude < 2^-126, below float32 precision next to the row's largest entries) becomes 0.

Tolerance (tests/layers/test_amla.py): float32 results equal the standard softmax path within 1e-5
relative (the only differences are summation order and exp2 vs exp rounding); in bfloat16 within the
usual 2e-2.

`--mla-decode amla` selects the torch version (any device); `--mla-decode amla-triton` the Triton kernel
(a GPU with Triton, or TRITON_INTERPRET=1 on CPU for tests). mla.py calls decode() through its selector
hook; the standard path stays the default.
"""
from __future__ import annotations

import math

import torch

from moeserve.config import MLA_DECODE_IMPLS
from moeserve.layers.attention.kv_dtype import gather_decode_context, read_block_columns

IMPLS = MLA_DECODE_IMPLS
LOG2E = 1.0 / math.log(2.0)
MANTISSA_BITS = 23  # float32
BLOCK = 64  # KV tokens per online-softmax step

_impl = "standard"


def set_decode_impl(name: str) -> None:
    """Select the MLA decode path for this process (the engine sets it from --mla-decode)."""
    global _impl
    if name not in IMPLS:
        raise ValueError(f"--mla-decode must be one of {', '.join(IMPLS)}, got {name!r}")
    if name == "amla-triton":
        _require_triton()
    _impl = name


def decode_impl() -> str:
    return _impl


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("--mla-decode amla-triton needs the triton package (pip install triton); "
                         "use --mla-decode amla for the torch version") from None


def scale_by_pow2_(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x *= 2^k in place for float32 x, as an integer add of k << 23 on x's bits; k (int32, <= 0)
    broadcasts against x. Zeros stay zero; entries that would become denormal become 0."""
    bits = x.view(torch.int32)
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    vanishing = (exponent + k <= 0) | (exponent == 0)
    bits.add_(k << MANTISSA_BITS)
    bits.masked_fill_(vanishing, 0)
    return x


def _online(q: torch.Tensor, tiles, scale: float, value_dim: int) -> torch.Tensor:
    """The exponent-add online softmax over `tiles`, an iterable of (kv tile [B, n, D] float32, mask [B, n]
    True where not attended); q [B, H, D]. Returns the latent output [B, H, value_dim] in q's dtype."""
    b, h, _ = q.shape
    qf = q.float() * (scale * LOG2E)  # scores in base 2
    out = torch.zeros(b, h, value_dim, dtype=torch.float32, device=q.device)
    total = torch.zeros(b, h, 1, dtype=torch.float32, device=q.device)
    m = torch.full((b, h, 1), -(1 << 30), dtype=torch.int32, device=q.device)  # integer running max
    for blk, masked in tiles:
        s = torch.bmm(qf, blk.transpose(1, 2))  # [B, H, n]
        s.masked_fill_(masked[:, None, :], float("-inf"))
        block_max = s.amax(dim=-1, keepdim=True)
        seen = torch.isfinite(block_max)  # a block wholly masked for this row changes nothing
        top = torch.ceil(block_max).clamp(-(1 << 30), 1 << 30).to(torch.int32)
        m_new = torch.where(seen, torch.maximum(m, top), m)
        # <= 0: what was accumulated is rescaled by 2^k; below -255 every float32 exponent vanishes anyway
        k = (m - m_new).clamp(min=-255)
        scale_by_pow2_(out, k)
        scale_by_pow2_(total, k)
        p = torch.exp2(s - m_new.float())  # masked -> 0; <= 1
        total += p.sum(dim=-1, keepdim=True)
        out.baddbmm_(p, blk[..., :value_dim])
        m = m_new
    return (out / total).to(q.dtype)


def amla_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float, value_dim: int,
                   block: int = BLOCK) -> torch.Tensor:
    """Absorbed MLA decode with exponent-add rescaling over a gathered context.

    q [B, H, D] (latent query and rope part), kv [B, L, D] (the latent cache rows, values = the first
    value_dim columns), mask [B, L] True where a position is not attended. Returns the latent output
    [B, H, value_dim] in q's dtype. Accumulates in float32."""
    tiles = ((kv[:, start:start + block].float(), mask[:, start:start + block])
             for start in range(0, kv.shape[1], block))
    return _online(q, tiles, scale, value_dim)


def amla_attention_paged(q: torch.Tensor, cache: torch.Tensor, d, scale: float, value_dim: int,
                         block: int = BLOCK) -> torch.Tensor:
    """amla_attention reading the paged cache [num_blocks, block_size, D] in place, tile by tile from d's
    block table (d: the step's DecodeBatch): each tile is the next block columns of every row (`block`
    tokens, or one block where blocks are larger), gathered into a small transient buffer; no row's whole
    context is copied. Slots past a row's length (stale, a failed request's NaN included) are zeroed in the
    tile: masked scores give p = 0, and 0 x NaN would still be NaN."""
    block_size = cache.shape[1]
    per_tile = max(1, block // block_size)
    columns = d.block_table.shape[1]

    def tiles():
        for first in range(0, columns, per_tile):
            count = min(per_tile, columns - first)
            blk = read_block_columns(cache, d.block_table, first, count, torch.float32)
            masked = d.mask[:, first * block_size:(first + count) * block_size]
            blk[masked.nonzero(as_tuple=True)] = 0.0  # the stale slots only: a masked_fill of the tile cost ~1.4x
            yield blk, masked

    return _online(q, tiles(), scale, value_dim)


def decode(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, d) -> torch.Tensor:
    """MLAttention._decode through AMLA: the same absorbed query and W_UV as the standard path. The torch
    version reads the paged cache block by block (amla_attention_paged); the Triton kernel takes the
    gathered context."""
    q_full = torch.cat([attn.absorb_query(q_nope), q_pe], dim=-1)  # [B, H, C + dr]
    if _impl == "amla-triton":
        from moeserve.layers.attention.amla_triton import amla_attention_triton
        kv = gather_decode_context(cache, d, q_nope.dtype)  # [B, L, C + dr]
        o_lat = amla_attention_triton(q_full, kv, d.mask, attn.scale, attn.kv_lora_rank)
    else:
        o_lat = amla_attention_paged(q_full, cache, d, attn.scale, attn.kv_lora_rank)
    return attn.value_up(o_lat)
