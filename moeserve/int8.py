"""INT8 symmetric quantization primitives: per output channel (weights) and per token (activations).

Below layers/ and distributed/ so the A8W8 layers (layers/quant.py), the INT8 MoE payload (layers/moe/
dispatch.py) and FlashComm's INT8 reduce-scatter (distributed/flashcomm.py) share one definition.
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric range [-127, 127]; -128 unused so that negation is exact
_EPS = 1e-12  # scale floor: an all-zero row quantizes to zeros instead of dividing by zero


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] float -> (q int8 [..., out, in], scale float32 [..., out, 1]); w ~= q * scale."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_(min=_EPS)
    return torch.round(wf / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


# Rows from which quantize_per_token takes the compiled kernel once an engine asked for it: prefill-sized
# inputs (decode rows are quantized inside the compiled decode graphs already).
COMPILED_MIN_ROWS = 64
_compiled = None


def compile_quantizer() -> None:
    """Send quantize_per_token's larger inputs through one inductor kernel (dynamic shapes: one graph per
    dtype): 8-9x faster than the eager passes at 1024 rows and bit-identical (tests/quant/test_int8_kernels.py).
    Called by engines that compile (not under --enforce-eager); the first call of each dtype compiles."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_quantize_per_token, dynamic=True, fullgraph=True)


def uncompile_quantizer() -> None:
    """Back to the eager quantizer until compile_quantizer() again (a dynamo reset dropped the compiled code)."""
    global _compiled
    _compiled = None


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q int8 [T, K], scale float32 [T, 1]), one dynamic scale per row (token)."""
    # is_compiling() first: a decode graph traced before compile_quantizer() must not read (and be guarded on)
    # _compiled, or setting it would send every such graph back to dynamo to be compiled again
    if not torch.compiler.is_compiling() and _compiled is not None and x.shape[0] >= COMPILED_MIN_ROWS:
        return _compiled(x.contiguous())  # one graph: strided rows would compile one of their own
    return _quantize_per_token(x)


def _quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager definition (and what inductor compiles).

    The hot path, so few passes (measured: BF16 reductions are ~4x slower than float32 ones here, hence one
    conversion first, into a private copy the later passes work on in place): one aminmax instead of an
    abs() temporary, a multiply by the reciprocal, and no clamp (|x| * 127 / amax <= 127 up to one ulp,
    which rounds to 127)."""
    xf = x.to(torch.float32, copy=True)
    lo, hi = torch.aminmax(xf, dim=-1, keepdim=True)
    scale = torch.maximum(hi, lo.neg_()).div_(QMAX).clamp_(min=_EPS)
    return xf.mul_(scale.reciprocal()).round_().to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [..., out, in] * scale [..., out, 1] -> dtype."""
    return (q.float() * scale.float()).to(dtype)
