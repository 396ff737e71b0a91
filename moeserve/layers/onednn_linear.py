"""BF16 Linears through the oneDNN matmul of vLLM's CPU kernel library (layers/cpu_kernels.py:
`create_onednn_mm_handler` / `onednn_mm`, the path vLLM's CPU build takes for its dense projections).

The library's handler keeps its own packed copy of the weight and a cache of oneDNN primitives keyed by row
count, so a call is the GEMM and little else; PyTorch's packed linear (layers/linear.py pack_weight) builds or
looks up its primitive per call through ideep. Measured on the bench model's projections, one thread: 0.73-0.92x
the time of PyTorch's packed linear at 1-1024 rows, the same bits as F.linear (docs/engine.md). The copy
replaces the oneDNN-packed one, so weight memory does not grow. With the library absent, for float32 weights,
or with MOESERVE_ONEDNN_LINEAR=0, Linears keep PyTorch's packed path.
"""
from __future__ import annotations

import functools
import os
import weakref

import torch

from moeserve.layers import cpu_kernels
from moeserve.layers.opaque import define_op

# Primitives the handler keeps (one per distinct row count: decode buckets and prefill chunk sizes); vLLM's
# choice for its Linears. Past it the least recent is rebuilt on its next use.
_PRIMITIVE_CACHE = 32


@functools.cache
def available() -> bool:
    """Enabled (MOESERVE_ONEDNN_LINEAR, default on) and the library loaded with the handler's ops."""
    return (os.environ.get("MOESERVE_ONEDNN_LINEAR", "1") != "0" and cpu_kernels.has("create_onednn_mm_handler")
            and cpu_kernels.has("onednn_mm") and cpu_kernels.has("release_dnnl_matmul_handler"))


def usable(weight: torch.Tensor) -> bool:
    """For a BF16 weight [N, K] on the CPU, with the library available."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and available())


def handler(weight: torch.Tensor) -> torch.Tensor:
    """The library's matmul handler for `weight` [N, K]: its own packed copy, built now. Returned as a 0-d int64
    tensor holding the handler's address (a tensor is a graph input, so one compiled graph serves every layer);
    the handler is released when that tensor is garbage collected. The tensor must not be copied: a copy
    would outlive the handler it points to."""
    address = torch.ops._C.create_onednn_mm_handler(weight.detach().t(), _PRIMITIVE_CACHE)
    handle = torch.tensor(address, dtype=torch.int64)
    weakref.finalize(handle, _release, address)
    return handle


def _release(address: int) -> None:
    torch.ops._C.release_dnnl_matmul_handler(address)


def _mm(x: torch.Tensor, handle: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.new_empty(x.shape[0], n)
    torch.ops._C.onednn_mm(out, x, bias, handle)
    return out


def _mm_shape(x: torch.Tensor, handle: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


@define_op("onednn_linear", "(Tensor x, Tensor handle, int n, Tensor? bias) -> Tensor", _mm_shape)
def _mm_op(x: torch.Tensor, handle: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _mm(x, handle, n, bias)


def linear(x: torch.Tensor, handle: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ the handler's weight^T (+ bias) -> [..., n] in x's dtype; an op of ours in a compiled graph
    (dynamo does not trace the library's ops)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    mm = torch.ops.moeserve.onednn_linear if torch.compiler.is_compiling() else _mm
    return mm(x2, handle, n, bias).view(*x.shape[:-1], n)
