"""A8W8 Linears through vLLM's INT8 GEMM (layers/cpu_kernels.py: `int8_scaled_mm_with_quant`, sgl-kernel's; AMX
tiles on Intel CPUs with AMX, AVX-512 VNNI without): the activations quantized per token inside the call, the
INT8 GEMM with the
per-channel weight scales, BF16 out; one call where the oneDNN path takes a quantization kernel, the uint8
flip and oneDNN's qlinear. The weight is our own copy in the kernel's VNNI layout (each row 4 bytes longer: a
compensation term; cpu_kernels.vnni_pack), made once at load. For a BF16 model's Linears whose output and
input widths are multiples of 32 (the kernel's blocks); elsewhere, with the library absent or with
MOESERVE_AMX_LINEAR=0, the oneDNN path runs as before. On AMD CPUs with zentorch a layer keeps both copies and
takes this kernel up to SMALL_ROWS rows, zentorch's above (layers/quant.py).
"""
from __future__ import annotations

import functools
import os

import torch

from moeserve.layers import cpu_kernels
from moeserve.layers.opaque import define_op

_OP = "int8_scaled_mm_with_quant"
# Rows up to which this kernel takes over from zentorch's INT8 linear where both run (AMD EPYC, Zen 4, one thread,
# the bench model's projections, 8 weights cycled: x0.61-0.73 of zentorch's time at 1 row, 0.66-0.76 at 4,
# 0.88-0.95 at 16, 0.97-1.09 at 64). Kept at 4: at batch 8 two whole-step runs disagreed (docs/quantization.md)
SMALL_ROWS = 4


@functools.cache
def available() -> bool:
    """Enabled (MOESERVE_AMX_LINEAR, default on), the library loaded with the kernel and allowed to run it
    (cpu_kernels.brgemm_ready: AMX granted to this process, or a CPU without AMX)."""
    return (os.environ.get("MOESERVE_AMX_LINEAR", "1") != "0" and cpu_kernels.brgemm_ready() and cpu_kernels.has(_OP)
            and cpu_kernels.has("convert_weight_packed"))


def usable(weight: torch.Tensor) -> bool:
    """For an INT8 weight [N, K] on the CPU with N and K multiples of 32 (the kernel's blocks)."""
    return (weight.dtype == torch.int8 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0 and available())


def _mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops._C.int8_scaled_mm_with_quant(x, packed, scale, bias, torch.bfloat16, True)


def _mm_shape(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], scale.numel(), dtype=torch.bfloat16)


@define_op("amx_int8_linear", "(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor", _mm_shape)
def _mm_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _mm(x, packed, scale, bias)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] BF16 @ the packed INT8 weight, times scale [N] float32 per output channel, + bias -> [..., N]
    BF16; an op of ours in a compiled graph (dynamo does not trace the library's ops)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if x2.shape[0] == 0:  # the kernel divides its work by the rows: none kill the process (SIGFPE)
        return x.new_empty(*x.shape[:-1], scale.numel())
    mm = torch.ops.moeserve.amx_int8_linear if torch.compiler.is_compiling() else _mm
    return mm(x2, packed, scale, None if bias is None else bias.float()).view(*x.shape[:-1], scale.numel())
