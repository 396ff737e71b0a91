"""Rotary position embedding with the YaRN scaling DeepSeek configs use.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, the default); we rotate the
even/odd halves and emit [rotated evens | rotated odds]. That permutes the rope dims, identically for q and
k, so every dot product (and so attention) is unchanged while the cache holds the permuted key.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor = rope["factor"]
    orig_max = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_mscale(factor))
    return inv_freq, float(attention_factor)


def softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """1/sqrt(d), times mscale^2 when YaRN's mscale_all_dim is set (DeepSeek's long-context fix)."""
    scale = qk_head_dim ** -0.5
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, max_positions: int, rope: dict, interleave: bool) -> None:
        super().__init__()
        base = rope["rope_theta"]
        # Real tensors even when the model is built on the meta device; plain attributes (not buffers)
        # so that to_empty() leaves them alone.
        with torch.device("cpu"):
            if rope["rope_type"] == "yarn":
                inv_freq, attention_factor = _yarn_inv_freq(rope, dim, base)
            else:
                inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
                attention_factor = 1.0
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, dim/2]
            self.cos = freqs.cos() * attention_factor
            self.sin = freqs.sin() * attention_factor
        self.interleave = interleave

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Rotate each x [T, heads, dim] (or [T, dim]) by its token's position [T]."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, dim/2]
        out = []
        for x in xs:
            c, s = (cos, sin) if x.dim() == 2 else (cos[:, None], sin[:, None])
            xf = x.float()
            if self.interleave:
                x1, x2 = xf[..., 0::2], xf[..., 1::2]
            else:
                x1, x2 = xf.chunk(2, dim=-1)
            out.append(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype))
        return out
