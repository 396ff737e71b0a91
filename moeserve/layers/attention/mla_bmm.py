"""MLA decode's per-head products with the absorbed matrices (W_UK on the query, W_UV on the latent output)
through vLLM's CPU kernel library's `bmm_cpu` (layers/cpu_kernels.py; the AMX batched GEMM vLLM's AMX MLA
backend uses for the same two products), over copies of the matrices in the kernel's VNNI layout made once
at load.

The same arithmetic as aten's weight-first bmm (mla.py's path up to 32 rows; past them its data-first bmm):
float32 accumulation, one rounding, equal outputs but for rare last-bit ties (a few in 10^4 one BF16 rounding
apart, as close to the float32 product as aten's: tests/layers/test_mla_bmm.py). On the bench model's
matrices (16 heads, C 512, dn = dv = 128; one thread, Intel Xeon with AMX) 0.63-0.87x of aten's time for W_UK
and 0.37-0.69x for W_UV at 1-256 rows; on an AMD EPYC (Zen 4: no AMX, the kernel's AVX-512 path) the same bits
as aten's at 1-64 rows in 0.11-0.83x its time for W_UK and 0.10-0.86x for W_UV (docs/engine.md). Where it
applies (usable()): BF16 matrices on the CPU whose widths are multiples of 32, the library loaded and its
GEMMs allowed to run (cpu_kernels.brgemm_ready: AMX usable by this process, or a CPU without AMX).
MOESERVE_MLA_BMM=0 switches it off; the aten bmm's run as before.
"""
from __future__ import annotations

import os

import torch

from moeserve.layers import cpu_kernels

ENV = "MOESERVE_MLA_BMM"


def usable(w: torch.Tensor) -> bool:
    """For per-head weights w [H, N, K] (each head's output width N and input width K, multiples of 32)."""
    return (os.environ.get(ENV, "1") != "0" and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and w.dim() == 3 and w.shape[1] % 32 == 0 and w.shape[2] % 32 == 0 and cpu_kernels.brgemm_ready()
            and cpu_kernels.has("bmm_cpu") and cpu_kernels.has("convert_weight_packed"))


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [H, N, K] in the kernel's layout, or None where the kernel does not apply (usable())."""
    return cpu_kernels.vnni_pack(w) if usable(w) else None


def per_head(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, H, K] -> [B, H, n]: each head's rows times its weight transposed (x[:, h] @ W[h]^T), contiguous."""
    if x.stride(-1) != 1:  # the kernel reads each row's K values as one run
        x = x.contiguous()
    out = x.new_empty(x.shape[0], x.shape[1], n)
    torch.ops._C.bmm_cpu(out.transpose(0, 1), x.transpose(0, 1), packed, True, None)
    return out
