"""What the routed experts do between and after their GEMMs, as single inductor kernels for prefill-sized steps.

Eager, each step is a pass over the step's [tokens x top-k, ...] rows: weighting the expert outputs, putting
them back in token order, summing each token's k rows; for INT8 experts also the activation scale, SwiGLU and
the per-token quantization of its output. At prefill sizes those passes cost as much as the GEMMs' weight
reads (one MoE layer of the V3-shaped bench model, 1024 tokens x top-6 of 64 experts, one thread: ~10 ms of
passes in ~36 ms). Each function here is one kernel reading its input once, with the eager code's bits
(tests/layers/test_expert_epilogue.py). Engines that compile turn them on (enable(), as
int8.compile_quantizer); under --enforce-eager, and for decode-sized inputs, callers keep the eager code.
"""
from __future__ import annotations

import torch

from moeserve.int8 import _quantize_per_token

MIN_ROWS = 64  # (token, expert) rows from which the kernels pay off their call: prefill, not decode
_combine = None
_swiglu_quant = None


def enable() -> None:
    """Compile the kernels on first use (dynamic shapes: a graph per dtype and top-k)."""
    global _combine, _swiglu_quant
    if _combine is None:
        # emulate_precision_casts: round to dtype where the code says so (inductor keeps float32 otherwise)
        _combine = _compiled(_combine_eager, options={"emulate_precision_casts": True})
        _swiglu_quant = _compiled(swiglu_quant_traceable)


def disable() -> None:
    """Back to the eager passes until enable() again (a dynamo reset dropped the compiled kernels)."""
    global _combine, _swiglu_quant
    _combine = _swiglu_quant = None


def _compiled(fn, **kwargs):
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, **kwargs)

    def call(*args):
        # A process may hold several engines (dtypes, quantizations, top-k): more graphs than dynamo's default
        # limit of 8 per function, past which fullgraph=True raises instead of running
        with torch._dynamo.config.patch(recompile_limit=_GRAPHS_PER_FUNCTION):
            return compiled(*args)
    return call


_GRAPHS_PER_FUNCTION = 64


def enabled_for(rows: int) -> bool:
    # is_compiling() first, as in int8.quantize_per_token: no decode graph guards on _combine
    return not torch.compiler.is_compiling() and _combine is not None and rows >= MIN_ROWS


def swiglu_quant_for(rows: int, intermediate: int) -> bool:
    """Whether swiglu_quant takes these rows."""
    return enabled_for(rows) and swiglu_bits_match(intermediate)


def swiglu_bits_match(intermediate: int) -> bool:
    """Whether inductor's SwiGLU has the eager bits at this width. ATen's SwiGLU on CPU runs the vector exp over
    whole steps of 32 floats a row and the scalar exp over the rest, and the two round differently now and
    then; inductor uses the vector exp throughout, so it matches only where every row is whole steps."""
    return intermediate % 32 == 0


def combine(y: torch.Tensor, scale: torch.Tensor, mine: torch.Tensor, tokens: int, k: int,
            dtype: torch.dtype) -> torch.Tensor:
    """y [R, H] expert outputs in group order, scale [R] float32 their factors, mine [R] the (token, expert)
    pair each row belongs to (pair i = token i // k, its (i % k)-th expert) -> [tokens, H] in dtype: per token
    the sum of dtype(y * scale) over its pairs, in pair order, in float32, rounded once (pairs with no row
    add 0). The eager definition: scatter into pair order, then sum over k."""
    n = tokens * k
    pos = torch.full((n,), -1, dtype=torch.long, device=y.device)
    pos[mine] = torch.arange(mine.numel(), device=y.device)
    return _combine(y, scale, pos, k, dtype)


def _combine_eager(y: torch.Tensor, scale: torch.Tensor, pos: torch.Tensor, k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    row = pos.clamp(min=0)
    weighted = (y[row].float() * scale[row, None]).to(dtype)  # rounded per pair, as the eager path stores it
    weighted = torch.where((pos >= 0)[:, None], weighted, torch.zeros((), dtype=dtype, device=y.device))
    pairs = weighted.view(-1, k, y.shape[1])
    # Summed in pair order, as torch.sum over k does eagerly: inductor's own reduction orders differently.
    total = pairs[:, 0].float()
    for j in range(1, k):
        total = total + pairs[:, j].float()
    return total.to(dtype)


def swiglu_quant(h: torch.Tensor, x_scale: torch.Tensor, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 experts between their GEMMs: h [R, 2I] gate/up sums before the activation scale (float32, or the
    model's dtype as the GEMMs wrote them), x_scale [R, 1] float32 -> quantize_per_token(silu(gate) * up) of
    h * x_scale in float32: (int8 [R, I], float32 [R, 1])."""
    return _swiglu_quant(h, x_scale, intermediate)


def swiglu_quant_traceable(h: torch.Tensor, x_scale: torch.Tensor, intermediate: int):
    """swiglu_quant's arithmetic as plain torch ops, for a graph that traces it (a decode graph's INT8 experts,
    layers/quant.py) or compiles it here; the eager bits where swiglu_quant_for's row rule holds."""
    h = h * x_scale
    gate = h[:, :intermediate]
    # silu as ATen's CPU kernel computes it, x / (1 + exp(-x)): inductor's own x * sigmoid(x) rounds differently
    return _quantize_per_token(gate / (1 + torch.exp(-gate)) * h[:, intermediate:])
