"""W8A8 INT8 (A8W8): INT8 weights with per-output-channel symmetric scales, INT8 activations quantized per
token at run time, INT32 accumulation, dequantized epilogue in float32.

    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]      (+ bias)

The INT32 GEMM is torch._int_mm where it runs (CPU: oneDNN s8s8s32, measured faster than BF16 here; CUDA:
cuBLASLt when M > 16 and K, N are multiples of 8); elsewhere an exact float fallback (see int8_mm).

Plugged in at the layer level, never in the model file:
- Linear gets an Int8LinearMethod (quant_method attribute): int8 `weight` [out, in] + `weight_scale` [out, 1]
  float32, the compressed-tensors names, so such checkpoints load straight into the parameters; a float
  weight arriving from the checkpoint is quantized at load.
- Int8FusedExperts replaces FusedExperts: int8 w13/w2 with per-row scales, rows grouped per expert once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.moe.experts import FusedExperts

QMAX = 127  # symmetric range [-127, 127]; -128 unused so that negation is exact
_EPS = 1e-12  # scale floor: an all-zero row quantizes to zeros instead of dividing by zero
_FALLBACK_K_CHUNK = 1024  # 1024 * 128 * 128 = 2^24: float32 sums stay exact integers per chunk


class QuantLoadError(ValueError):
    """A checkpoint tensor that cannot go into a quantized parameter; names the tensor."""


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] float -> (q int8 [..., out, in], scale float32 [..., out, 1]); w ~= q * scale."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_(min=_EPS)
    return torch.round(wf / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q int8 [T, K], scale float32 [T, 1]), one dynamic scale per row (token).

    The hot path, so fewer passes than quantize_per_channel (measured: BF16 reductions are ~4x slower than
    float32 ones here, hence one conversion first): max(amax, -amin) instead of an abs() temporary, a multiply
    by the reciprocal, and no clamp (|x| * 127 / amax <= 127 up to one ulp, which rounds to 127)."""
    xf = x.float()
    amax = torch.maximum(xf.amax(dim=-1, keepdim=True), xf.amin(dim=-1, keepdim=True).neg_())
    scale = amax.div_(QMAX).clamp_(min=_EPS)
    return (xf * scale.reciprocal()).round_().to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [..., out, in] * scale [..., out, 1] -> dtype."""
    return (q.float() * scale.float()).to(dtype)


def _int_mm_runs(a: torch.Tensor, w: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        return True  # any shape (checked on torch 2.13, oneDNN)
    if a.device.type == "cuda":
        return a.shape[0] > 16 and a.shape[1] % 8 == 0 and w.shape[0] % 8 == 0
    return False


def int8_mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
            force_fallback: bool = False) -> torch.Tensor:
    """a [M, K] int8 activations, w [N, K] int8 weight (row-major, as stored) -> [M, N] int32 = a @ w.T."""
    assert a.dtype == torch.int8 and w.dtype == torch.int8, (a.dtype, w.dtype)
    assert a.dim() == 2 and w.dim() == 2 and a.shape[1] == w.shape[1], (a.shape, w.shape)
    if not force_fallback and _int_mm_runs(a, w):
        return torch._int_mm(a, w.t(), out=out)
    res = _int8_mm_fallback(a, w)
    return res if out is None else out.copy_(res)


def _int8_mm_fallback(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact INT32 result from float GEMMs: float64 on CUDA (no TF32), float32 in K-chunks elsewhere."""
    if a.device.type == "cuda":
        return (a.double() @ w.double().t()).to(torch.int32)
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.int32, device=a.device)
    for k in range(0, a.shape[1], _FALLBACK_K_CHUNK):
        part = a[:, k:k + _FALLBACK_K_CHUNK].float() @ w[:, k:k + _FALLBACK_K_CHUNK].float().t()
        acc += part.to(torch.int32)
    return acc


def int8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float; wq [N, K] int8; w_scale [N, 1] float32 -> [..., N] in x.dtype."""
    lead = x.shape[:-1]
    xq, xs = quantize_per_token(x.reshape(-1, x.shape[-1]))  # [M, K] int8, [M, 1]
    y = int8_mm(xq, wq).float().mul_(xs).mul_(w_scale.view(1, -1))  # [M, N] float32
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*lead, wq.shape[0])


def _checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise QuantLoadError(f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}")
    if src.dtype == torch.int8 and dst.dtype != torch.int8:
        raise QuantLoadError(f"tensor {name} is INT8 but its parameter is {dst.dtype}")
    with torch.no_grad():
        dst.copy_(src)


def _check_zero_point(tensor: torch.Tensor, name: str) -> None:
    if tensor.count_nonzero():
        raise QuantLoadError(f"tensor {name} has a non-zero zero point: only symmetric INT8 is supported")


class Int8LinearMethod:
    """How a Linear holds and applies A8W8 weights. Stateless; the tensors live on the layer."""

    @staticmethod
    def create_weights(layer: nn.Module) -> None:
        """Swap the float weight for int8 weight [out, in] + weight_scale [out, 1] (same device, e.g. meta)."""
        dev = layer.weight.device
        layer.orig_dtype = layer.weight.dtype  # the model dtype: what dequantized_weight() returns
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.int8,
                                                device=dev), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, 1, dtype=torch.float32, device=dev),
                                          requires_grad=False)
        layer.quant_method = Int8LinearMethod

    @staticmethod
    def load_tensor(layer: nn.Module, leaf: str, tensor: torch.Tensor, name: str) -> list[str]:
        """Fill from one checkpoint tensor; returns the parameter leaves filled."""
        if leaf == "weight" and tensor.dtype != torch.int8:  # float (or dequantized FP8): quantize now
            q, s = quantize_per_channel(tensor)
            _checked(layer.weight, q, name)
            layer.weight_scale.data.copy_(s)
            return ["weight", "weight_scale"]
        if leaf == "weight_zero_point":
            _check_zero_point(tensor, name)
            return []
        if leaf == "weight_scale":
            tensor = tensor.float().reshape(-1, 1) if tensor.numel() == layer.out_features else tensor
        _checked(getattr(layer, leaf), tensor, name)
        return [leaf]

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, layer.bias)

    @staticmethod
    def dequantized_weight(layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, layer.weight_scale, layer.orig_dtype)


class Int8FusedExperts(FusedExperts):
    """Routed experts in A8W8: w13 int8 [E, 2I, H] + w13_scale [E, 2I]; w2 int8 [E, H, I] + w2_scale [E, H].

    Rows are sorted by expert once; each expert then costs one INT8 GEMM per projection on a contiguous
    slice, while quantization, dequantization and SwiGLU run batched over all rows.
    """

    CHECKPOINT_LEAVES = ("weight", "weight_scale")

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int,
                 slot_experts: list[int] | None = None) -> None:
        super().__init__(num_local_experts, hidden, intermediate, slot_experts)
        e = num_local_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * intermediate, hidden, dtype=torch.int8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden, intermediate, dtype=torch.int8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(e, 2 * intermediate, dtype=torch.float32), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(e, hidden, dtype=torch.float32), requires_grad=False)

    @classmethod
    def like(cls, base: FusedExperts) -> "Int8FusedExperts":
        """The INT8 counterpart of `base` (same slots), on base's device (meta before loading)."""
        with torch.device(base.w13.device):
            ex = cls(base.num_local_experts, base.w13.shape[-1], base.intermediate, base.slot_experts)
        ex.shard_rank, ex.num_shards = base.shard_rank, base.num_shards  # TP-sharded slice (intermediate is local)
        return ex

    def expert_scale(self, slot: int, proj: str) -> torch.Tensor:
        """View of one expert's per-row scales, [I] (gate_proj / up_proj) or [H] (down_proj)."""
        if proj == "down_proj":
            return self.w2_scale[slot]
        i = self.intermediate
        return self.w13_scale[slot, :i] if proj == "gate_proj" else self.w13_scale[slot, i:]

    def load_expert(self, slot: int, proj: str, leaf: str, tensor: torch.Tensor, name: str) -> list[str]:
        w, s = self.expert_weight(slot, proj), self.expert_scale(slot, proj)
        if leaf == "weight_zero_point":
            _check_zero_point(tensor, name)
            return []
        if leaf == "weight" and tensor.dtype != torch.int8:
            q, scale = quantize_per_channel(tensor)
            _checked(w, q, name)
            s.copy_(scale.view(-1))
            return ["weight", "weight_scale"]
        if leaf == "weight":
            _checked(w, tensor, name)
        else:
            _checked(s, tensor.float().reshape(-1), name)
        return [leaf]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in float32, for references and checks."""
        return dequantize(self.w13, self.w13_scale[..., None]), dequantize(self.w2, self.w2_scale[..., None])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same contract as FusedExperts.forward: x [N, H], expert_ids [N] (-1 skipped), weights [N]."""
        assert x.dim() == 2 and expert_ids.shape == weights.shape == (x.shape[0],)
        out = torch.zeros_like(x)
        order = expert_ids.argsort(stable=True)
        counts = torch.bincount(expert_ids.clamp(min=-1) + 1, minlength=self.num_local_experts + 1).tolist()
        rows = order[counts[0]:]  # [R] our rows, grouped by expert (-1 rows sort first)
        if rows.numel() == 0:
            return out
        ids = expert_ids[rows]  # [R]
        xq, xs = quantize_per_token(x[rows])  # [R, H] int8, [R, 1]
        h = self._grouped_mm(xq, self.w13, counts[1:])  # [R, 2I] int32
        h = h.float().mul_(xs).mul_(self.w13_scale[ids])
        gate, up = h.split(self.intermediate, dim=-1)
        aq, a_s = quantize_per_token(F.silu(gate) * up)  # [R, I] int8, [R, 1]
        y = self._grouped_mm(aq, self.w2, counts[1:])  # [R, H] int32
        y = y.float().mul_(a_s * weights[rows, None]).mul_(self.w2_scale[ids])
        out[rows] = y.to(x.dtype)
        return out

    @staticmethod
    def _grouped_mm(aq: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """aq [R, K] int8 grouped by expert (counts[e] rows each), w [E, N, K] int8 -> [R, N] int32."""
        acc = torch.empty(aq.shape[0], w.shape[1], dtype=torch.int32, device=aq.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                int8_mm(aq[start:start + n], w[e], out=acc[start:start + n])
                start += n
        return acc
