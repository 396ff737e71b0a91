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
from moeserve.layers.attention.kv_dtype import gather_decode_context

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


def amla_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float, value_dim: int,
                   block: int = BLOCK) -> torch.Tensor:
    """Absorbed MLA decode with exponent-add rescaling.

    q [B, H, D] (latent query and rope part), kv [B, L, D] (the latent cache rows, values = the first
    value_dim columns), mask [B, L] True where a position is not attended. Returns the latent output
    [B, H, value_dim] in q's dtype. Accumulates in float32."""
    b, h, _ = q.shape
    length = kv.shape[1]
    qf = q.float() * (scale * LOG2E)  # scores in base 2
    out = torch.zeros(b, h, value_dim, dtype=torch.float32, device=q.device)
    total = torch.zeros(b, h, 1, dtype=torch.float32, device=q.device)
    m = torch.full((b, h, 1), -(1 << 30), dtype=torch.int32, device=q.device)  # integer running max
    for start in range(0, length, block):
        blk = kv[:, start:start + block].float()
        s = torch.bmm(qf, blk.transpose(1, 2))  # [B, H, n]
        s.masked_fill_(mask[:, None, start:start + block], float("-inf"))
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


def decode(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, d) -> torch.Tensor:
    """MLAttention._decode through AMLA: the same absorbed query and W_UV as the standard path."""
    kv = gather_decode_context(cache, d, q_nope.dtype)  # [B, L, C + dr]
    q_full = torch.cat([attn.absorb_query(q_nope), q_pe], dim=-1)  # [B, H, C + dr]
    if _impl == "amla-triton":
        from moeserve.layers.attention.amla_triton import amla_attention_triton
        o_lat = amla_attention_triton(q_full, kv, d.mask, attn.scale, attn.kv_lora_rank)
    else:
        o_lat = amla_attention(q_full, kv, d.mask, attn.scale, attn.kv_lora_rank)
    return attn.value_up(o_lat)
