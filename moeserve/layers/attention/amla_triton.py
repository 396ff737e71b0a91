"""AMLA decode as a Triton kernel (see amla.py for the method): one program per (sequence, head) walks the
latent KV in blocks; the float32 output accumulator and the running sum are rescaled by adding k << 23 to
their bits (tl bitcast to int32), with the same zero / denormal guards as the torch version.

Runs on GPUs with Triton, and on CPU under TRITON_INTERPRET=1 (set before this module is imported), which
is how tests/layers/test_amla.py checks it against the standard path.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _pow2_scale(x, k):
    """x * 2^k for float32 x and integer k <= 0 as an add on the exponent bits."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    scaled = bits + (k << 23)
    scaled = tl.where((exponent + k <= 0) | (exponent == 0), 0, scaled)
    return scaled.to(tl.float32, bitcast=True)


@triton.jit
def _amla_kernel(q_ptr, kv_ptr, mask_ptr, out_ptr, length, heads, dim, value_dim, qk_scale,
                 stride_qb, stride_qh, stride_kb, stride_kl, stride_mb, stride_ob, stride_oh,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // heads
    h = pid % heads
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_C)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d < dim, other=0.0).to(tl.float32) * qk_scale
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    m = tl.full([1], -(1 << 30), dtype=tl.int32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < length
        masked = tl.load(mask_ptr + b * stride_mb + n, mask=inside, other=1) != 0
        rows = kv_ptr + b * stride_kb + n[:, None] * stride_kl
        blk = tl.load(rows + d[None, :], mask=inside[:, None] & (d[None, :] < dim), other=0.0).to(tl.float32)
        s = tl.sum(blk * q[None, :], axis=1)
        s = tl.where(masked, float("-inf"), s)
        block_max = tl.max(s, axis=0)
        if block_max > float("-inf"):
            top = tl.minimum(tl.maximum(tl.ceil(block_max), -(1 << 30)), 1 << 30).to(tl.int32)
            m_new = tl.maximum(m, top)
            k = tl.maximum(m - m_new, -255)
            acc = _pow2_scale(acc, k)
            total = _pow2_scale(total, k)
            p = tl.exp2(s - m_new.to(tl.float32))
            total += tl.sum(p, axis=0)
            v = tl.load(rows + c[None, :], mask=inside[:, None] & (c[None, :] < value_dim), other=0.0).to(tl.float32)
            acc += tl.sum(p[:, None] * v, axis=0)
            m = m_new
    tl.store(out_ptr + b * stride_ob + h * stride_oh + c, acc / total, mask=c < value_dim)


def amla_attention_triton(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float,
                          value_dim: int, block: int = 64) -> torch.Tensor:
    """amla.amla_attention's contract: q [B, H, D], kv [B, L, D], mask [B, L] (True = not attended) ->
    [B, H, value_dim] in q's dtype."""
    b, h, dim = q.shape
    length = kv.shape[1]
    q, kv = q.contiguous(), kv.contiguous()
    mask_i8 = mask.to(torch.int8).contiguous()
    out = torch.empty(b, h, value_dim, dtype=torch.float32, device=q.device)
    _amla_kernel[(b * h,)](q, kv, mask_i8, out, length, h, dim, value_dim, scale * LOG2E,
                           q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), mask_i8.stride(0),
                           out.stride(0), out.stride(1),
                           BLOCK_N=block, BLOCK_D=triton.next_power_of_2(dim),
                           BLOCK_C=triton.next_power_of_2(value_dim))
    return out.to(q.dtype)
