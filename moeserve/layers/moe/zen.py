"""Routed BF16 experts through AMD's zentorch (ZenDNN) on AMD EPYC CPUs: one fused call per MoE layer
(`zentorch_fused_moe`: grouped gate/up GEMM, SwiGLU, grouped down GEMM, weighted sum per token) in place
of one oneDNN GEMM pair per busy expert. Measured 2.5-3x faster per layer at decode batch 8-64
(benchmarks/packed_experts.py --zentorch). The same kernel vLLM's CPU backend calls on Zen CPUs.

zentorch is optional (`pip install 'moeserve[zen]'`; its version must match torch's major.minor, it refuses
to load otherwise); without it, or on another CPU, or with MOESERVE_ZENTORCH=0, the experts run as before.

Its weight cache: ZenDNN reorders each expert's weights into its blocked layout on the first call and keeps
the result keyed by the weight's address. Two consequences, handled here:
- the default cache mode reorders *in place*, overwriting the raw weights that the compiled graphs, EPLB and
  the checkpoint views still read; the out-of-place mode (ZENDNNL_MATMUL_WEIGHT_CACHE=1, set before zentorch
  loads) keeps them, at the cost of a second copy (what the oneDNN-packed copies cost before);
- an address whose contents changed (new weights where freed ones were, an EPLB move) would hit a stale entry
  and compute with the old weights, silently: flush_cache() is called whenever expert weights are loaded or
  moved, and when experts are freed, so every entry the kernel finds was made from the weights there now.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

# ZenDNN reads its cache mode once, at its first call: out-of-place, so the raw weights stay as they are
_CACHE_ENV = "ZENDNNL_MATMUL_WEIGHT_CACHE"
_OUT_OF_PLACE = "1"


def _zen_cpu() -> bool:
    """An AMD CPU (zentorch's target; vLLM gates its zentorch paths the same way)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


@functools.cache
def available() -> bool:
    """zentorch's fused MoE can run here: enabled (MOESERVE_ZENTORCH, default on), an AMD CPU, zentorch
    installed for this torch and exposing the op. Imports zentorch on first use only."""
    if os.environ.get("MOESERVE_ZENTORCH", "1") == "0" or not _zen_cpu():
        return False
    if importlib.util.find_spec("zentorch") is None:
        return False
    if os.environ.get(_CACHE_ENV, _OUT_OF_PLACE) != _OUT_OF_PLACE:
        logger.warning("%s=%s would let zentorch overwrite the expert weights in place; routed experts run "
                       "without zentorch", _CACHE_ENV, os.environ[_CACHE_ENV])
        return False
    os.environ[_CACHE_ENV] = _OUT_OF_PLACE
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except Exception as e:  # a zentorch built for another torch refuses to load
        logger.warning("zentorch is installed but does not load (%s); routed experts run without it", e)
        return False
    ok = hasattr(torch.ops.zentorch, "zentorch_fused_moe")
    if ok:
        logger.info("routed BF16 experts run through zentorch's fused MoE")
    return ok


def usable(w13: torch.Tensor) -> bool:
    """For these expert weights: BF16 on the CPU, and zentorch available."""
    return w13.dtype == torch.bfloat16 and w13.device.type == "cpu" and available()


def cache_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Memory zentorch's cache holds for one layer's experts once they ran: measured as the RSS growth of each
    layer's first call (bench shapes, 64 experts, all used): 201 MB for 101 MB of BF16 weights, 51 MB for 50 MB
    of INT8 ones. The KV sizing leaves room for it (linear.packed_copy_bytes)."""
    return (2 if w13.dtype == torch.bfloat16 else 1) * (w13.nbytes + w2.nbytes)


def flush_cache() -> None:
    """Forget every reordered expert weight, BF16 and INT8 (made again, from the weights in place, on next
    use). Two caches: zentorch_clear_weight_cache drops the BF16 experts' entries (zentorch_flush_moe_weight_cache
    alone does not: new weights at a freed address still computed with the old), zentorch_flush_moe_weight_cache
    the INT8 experts' (the former alone does not). Checked in tests/layers/test_zen_experts.py and
    tests/quant/test_int8_zen.py."""
    if available():
        torch.ops.zentorch.zentorch_clear_weight_cache()
        torch.ops.zentorch.zentorch_flush_moe_weight_cache()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """x [T, H] BF16; w13 [E, 2I, H] (gate; up); w2 [E, H, I]; expert_ids [T, k] local slots (all >= 0);
    weights [T, k] float32 -> [T, H]: sum over j of weights[t, j] * expert_{ids[t, j]}(x[t])."""
    out = torch.empty_like(x)
    if x.shape[0] == 0:  # no rows (a rank that received none): ZenDNN would log a null-pointer error
        return out
    torch.ops.zentorch.zentorch_fused_moe(out, x.contiguous(), w13, w2, None, None,
                                          weights.float().contiguous(), expert_ids.to(torch.int32).contiguous(),
                                          False, "silu")
    return out


def usable_int8(w13: torch.Tensor) -> bool:
    """For A8W8 expert weights (layers/quant.py Int8FusedExperts): INT8 on the CPU, and zentorch available;
    MOESERVE_ZENTORCH_INT8=0 switches off this use only (the BF16 experts keep zentorch)."""
    return (w13.dtype == torch.int8 and w13.device.type == "cpu"
            and os.environ.get("MOESERVE_ZENTORCH_INT8", "1") != "0" and available())


def usable_int8_linear(weight: torch.Tensor) -> bool:
    """For an A8W8 Linear's weight (layers/quant.py Int8LinearMethod): INT8 on the CPU, zentorch available with
    its dynamic-quantization INT8 linear; MOESERVE_ZENTORCH_INT8=0 switches it off with the INT8 experts."""
    return usable_int8(weight) and hasattr(torch.ops.zentorch, "zentorch_dynamic_qlinear")


def pack_int8_linear(weight: torch.Tensor) -> torch.Tensor:
    """An INT8 weight [N, K] in zentorch's layout for zentorch_dynamic_qlinear: our own copy, self-contained
    (its storage also holds a per-channel compensation term: N x 4 bytes past the N x K); no address-keyed
    cache is involved (checked: new weights at a freed address compute with the new ones)."""
    return torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(weight.detach().contiguous())


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] BF16 (quantized per token inside, symmetric, as int8.quantize_per_token) @ the packed INT8
    weight, times scale [N] float32 per output channel, + bias -> [M, N] BF16."""
    return torch.ops.zentorch.zentorch_dynamic_qlinear(x, packed, scale, bias, is_weight_prepacked=True)


def fused_moe_int8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                   w2_scale: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A8W8 experts in one call: x [T, H] BF16; w13 int8 [E, 2I, H] with w13_scale float32 [E, 2I] (one
    symmetric scale per output channel); w2 int8 [E, H, I] with w2_scale float32 [E, H]; expert_ids [T, k]
    local slots (all >= 0); weights [T, k] float32 -> [T, H] BF16. zentorch quantizes the activations itself
    (per token, symmetric INT8, before each GEMM), as Int8FusedExperts.forward does. The scales must be
    float32: vLLM notes that BF16 scales silently take a slower per-expert path."""
    out = torch.empty_like(x)
    if x.shape[0] == 0:  # no rows (a rank that received none): ZenDNN would log a null-pointer error
        return out
    torch.ops.zentorch.zentorch_fused_moe(out, x.contiguous(), w13, w2, None, None,
                                          weights.float().contiguous(), expert_ids.to(torch.int32).contiguous(),
                                          False, "silu", w13_scale, w2_scale)
    return out
