"""Routed experts through vLLM's AMX fused MoE kernels (layers/cpu_kernels.py) on Intel CPUs with AMX: one call
per MoE layer (grouped gate/up GEMM, SwiGLU, grouped down GEMM, the weighted sum per token) in place of one
oneDNN GEMM pair per busy expert, the ~14-25 us of call overhead each of those pays.
- BF16 experts: `cpu_fused_moe` with isa "amx", over a copy of the weights in its tile layout
  (`prepack_moe_weight`: same shape, reordered), vLLM's own x86 path for unquantized MoE;
- A8W8 experts: `fused_experts_cpu` in its INT8_W8A8 mode (sgl-kernel's), over weights in its VNNI layout
  (`cpu_kernels.vnni_pack`: each row 4 bytes longer, a compensation term), the per-channel scales as they are;
  it quantizes the activations per token itself before each GEMM, as Int8FusedExperts does.
Both need hidden and intermediate sizes divisible by 32 (the kernels' tiles); elsewhere, with the library
absent, on a CPU without AMX, or with MOESERVE_AMX_MOE=0, the experts run as before. The packed copies are
ours (no address-keyed cache): they are remade from the stacked weights after every load and EPLB move.
"""
from __future__ import annotations

import functools
import os

import torch

from moeserve.layers import cpu_kernels

ALIGN = 32  # the kernels' tile width: hidden and intermediate sizes must be multiples of it
_INT8_W8A8 = 1  # fused_experts_cpu's moe_comp_method for INT8 weights with per-token INT8 activations


@functools.cache
def available() -> bool:
    """The kernels can run here: enabled (MOESERVE_AMX_MOE, default on), AMX usable by this process
    (cpu_kernels.amx), vLLM's library loaded."""
    return (os.environ.get("MOESERVE_AMX_MOE", "1") != "0" and cpu_kernels.amx()
            and cpu_kernels.has("cpu_fused_moe") and cpu_kernels.has("fused_experts_cpu")
            and cpu_kernels.has("convert_weight_packed"))


def _fits(w13: torch.Tensor) -> bool:
    """w13 [E, 2I, H] on the CPU with I and H multiples of the kernels' tiles."""
    return (w13.device.type == "cpu" and w13.shape[-1] % ALIGN == 0 and w13.shape[1] % (2 * ALIGN) == 0
            and w13.shape[0] > 0)


def usable(w13: torch.Tensor) -> bool:
    """For BF16 expert weights w13 [E, 2I, H]."""
    return w13.dtype == torch.bfloat16 and _fits(w13) and available()


def usable_int8(w13: torch.Tensor) -> bool:
    """For INT8 expert weights w13 [E, 2I, H] (per-channel float32 scales beside them)."""
    return w13.dtype == torch.int8 and _fits(w13) and available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """BF16 expert weights [E, N, K] in cpu_fused_moe's AMX layout (a new tensor of the same shape)."""
    out = torch.empty_like(w)
    torch.ops._C.prepack_moe_weight(w.detach().contiguous(), out, "amx")
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """x [T, H] BF16; w13 / w2 packed by pack(); expert_ids [T, k] local slots (all >= 0); weights [T, k] float32
    -> [T, H] BF16: sum over j of weights[t, j] * expert_{ids[t, j]}(x[t])."""
    out = torch.empty_like(x)
    if x.shape[0]:
        torch.ops._C.cpu_fused_moe(out, x.contiguous(), w13, w2, None, None, weights.float().contiguous(),
                                   expert_ids.to(torch.int32).contiguous(), False, "silu", "amx")
    return out


def fused_moe_int8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                   w2_scale: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A8W8 experts in one call: x [T, H] BF16; w13 / w2 packed by cpu_kernels.vnni_pack() with their float32
    per-channel scales [E, 2I] / [E, H]; expert_ids [T, k] local slots (all >= 0); weights [T, k] float32 ->
    [T, H] BF16."""
    out = torch.empty_like(x)
    if x.shape[0]:
        torch.ops._C.fused_experts_cpu(out, x.contiguous(), w13, w2, weights.float().contiguous(),
                                       expert_ids.to(torch.int32).contiguous(), _INT8_W8A8, w13_scale, w2_scale,
                                       None, None, None, None, None, None, None, None, True)
    return out
