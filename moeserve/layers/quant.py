"""W8A8 INT8 (A8W8): INT8 weights with per-output-channel symmetric scales, INT8 activations quantized per
token at run time, INT32 accumulation, dequantized epilogue in float32.

    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]      (+ bias)

On CPUs with an INT8 dot-product unit (VNNI or AMX) the weights are packed once at load into oneDNN's
blocked INT8 layout (Int8Packed: onednn.qlinear_pointwise on uint8-shifted activations, the weight scales in
its epilogue, float32 out). Elsewhere the INT32 GEMM is torch._int_mm where it runs (CPU: oneDNN's
unpacked kernel; CUDA: cuBLASLt when M > 16 and K, N are multiples of 8), else an exact float fallback
(see int8_mm).

Plugged in at the layer level, never in the model file:
- Linear gets an Int8LinearMethod (quant_method attribute): int8 `weight` [out, in] + `weight_scale` [out, 1]
  float32, the compressed-tensors names, so such checkpoints load straight into the parameters; a float
  weight arriving from the checkpoint is quantized at load.
- Int8FusedExperts replaces FusedExperts: int8 w13/w2 with per-row scales. On AMD CPUs with zentorch, BF16
  activations go through zentorch's fused MoE in its INT8 mode (one call per layer, layers/moe/zen.py), on
  Intel CPUs with AMX through vLLM's INT8 fused MoE (layers/moe/amx.py);
  otherwise rows are grouped per expert once and each busy expert is one INT8 GEMM per projection.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.int8 import QMAX, dequantize, quantize_per_channel, quantize_per_token  # noqa: F401 (A8W8's API)
from moeserve.layers import amx_linear, cpu_kernels
from moeserve.layers.moe import amx, expert_epilogue, zen
from moeserve.layers.opaque import define_op
from moeserve.layers.moe.experts import FusedExperts, grouped_on_host, stored

_FALLBACK_K_CHUNK = 1024  # 1024 * 128 * 128 = 2^24: float32 sums stay exact integers per chunk


class QuantLoadError(ValueError):
    """A checkpoint tensor that cannot go into a quantized parameter; names the tensor."""


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


def int8_rows_dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [P, K] int8, w [P, N, K] int8 (row p's own weight) -> [P, N] float32 = float(sum_k a[p, k] w[p, n, k]),
    exact, so the bits of float(int8_mm(...)): float32 sums of <= _FALLBACK_K_CHUNK products are exact
    integers, longer rows add their chunks' sums in int32. Written for inductor, which fuses it into one
    reduction loop (a gathered w included); eagerly it would materialize float copies."""
    p, k = a.shape
    if k <= _FALLBACK_K_CHUNK:
        return torch.einsum("pnk,pk->pn", w.float(), a.float())
    c = max(d for d in range(1, _FALLBACK_K_CHUNK + 1) if k % d == 0)  # chunks of equal length
    parts = torch.einsum("pnjc,pjc->pnj", w.reshape(p, -1, k // c, c).float(), a.reshape(p, k // c, c).float())
    return parts.to(torch.int32).sum(-1).float()


def int8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, packed: "Int8Packed | None" = None) -> torch.Tensor:
    """x [..., K] float; wq [N, K] int8; w_scale [N, 1] float32 -> [..., N] in x.dtype.
    `packed` (the same weight, packed at load) runs the GEMM and the weight-scale epilogue in oneDNN."""
    lead = x.shape[:-1]
    xq, xs = quantize_per_token(x.reshape(-1, x.shape[-1]))  # [M, K] int8, [M, 1]
    if packed is not None and packed.pays(xq.shape[0]):
        y = packed.mm_scaled(xq).mul_(xs)  # [M, N] float32
    else:
        y = torch.mul(int8_mm(xq, wq), w_scale.view(1, -1)).mul_(xs)  # int32 * float32 -> float32, as packed
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*lead, wq.shape[0])


def _cpu_int8_unit() -> str | None:
    """The CPU's INT8 dot-product unit that oneDNN's packed GEMMs run on: "amx", "vnni" (AVX-512 VNNI or
    AVX-VNNI) or None (oneDNN would run them on a slow reference kernel)."""
    global _INT8_UNIT
    if _INT8_UNIT == "unknown":
        try:
            cap = torch._C._cpu._get_cpu_capability()
            if cap.get("amx_int8") and torch._C._cpu._init_amx():  # the kernel must grant this process AMX
                _INT8_UNIT = "amx"
            elif cap.get("avx512_vnni") or cap.get("avx_vnni"):
                _INT8_UNIT = "vnni"
            else:
                _INT8_UNIT = None
        except (AttributeError, RuntimeError):
            _INT8_UNIT = None
    return _INT8_UNIT


_INT8_UNIT: str | None = "unknown"
_U8_ZERO_POINT = 128  # int8 v -> uint8 v + 128 (the sign bit flipped): oneDNN's fast x86 kernels are u8 x s8
# Without AMX a oneDNN call costs ~50-100 us more than torch._int_mm at these sizes, so packing pays only for
# larger weights and more than one row (benchmarks/packed_linear.py --int8, AVX-512 VNNI, torch 2.13: at 8
# rows x1.35 for [4096 x 1024], x0.60 for [384 x 1024]; at 1 row x0.5-1.0 below lm_head's size).
_VNNI_PACK_MIN_ELEMENTS = 1 << 20
_VNNI_PACK_MIN_ROWS = 2
_VNNI_PACK_ONE_ROW_ELEMENTS = 4 << 20  # one row: x1.1-1.15 from [4096 x 1024] up, slower below


class Int8Packed:
    """One INT8 weight [N, K] with per-row scales, packed once for oneDNN (the CPU's VNNI / AMX INT8 kernels).

    mm_scaled(xq) = (xq @ w.T) * w_scale in float32: exact INT32 accumulation, then one float32 multiply per
    element, the same arithmetic as int8_mm(...).float() * w_scale. The activations go in as uint8 with zero
    point 128: x86's VNNI / AMX dot products are u8 x s8, and with int8 activations oneDNN falls back to its
    reference kernel (measured on an AVX-512 VNNI CPU, torch 2.13: 349 ms for 8 rows of a [1024 x 2048]
    weight as s8, 0.11 ms as u8, 0.44 ms for torch._int_mm; exact either way). Where oneDNN has no fast
    kernel (CUDA, a build without it, a CPU without VNNI or AMX) `of` returns None and callers keep the
    int8_mm path."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed = packed
        self.scale = scale.reshape(-1).float().contiguous()  # [N]
        self.zero_points = torch.zeros(self.scale.numel(), dtype=torch.long)

    @property
    def nbytes(self) -> int:
        """Memory the packed copy holds beside the layer's INT8 parameter (the KV sizing counts it)."""
        return self.packed.numel() * self.packed.element_size() + self.scale.numel() * 4

    @classmethod
    def of(cls, wq: torch.Tensor, w_scale: torch.Tensor) -> "Int8Packed | None":
        unit = _cpu_int8_unit() if wq.device.type == "cpu" and torch.backends.mkldnn.is_available() else None
        if unit is None or (unit == "vnni" and wq.numel() < _VNNI_PACK_MIN_ELEMENTS):
            return None
        try:
            return cls(torch.ops.onednn.qlinear_prepack(wq.contiguous(), None), w_scale)
        except (RuntimeError, AttributeError, NotImplementedError):
            return None

    def pays(self, rows: int) -> bool:
        """Whether this GEMM of `rows` rows is faster packed than through torch._int_mm."""
        return (_cpu_int8_unit() == "amx" or rows >= _VNNI_PACK_MIN_ROWS
                or self.packed.numel() >= _VNNI_PACK_ONE_ROW_ELEMENTS)

    def mm_scaled(self, xq: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor lowers oneDNN's qlinear only for frozen (constant) weights
            xu = xq.view(torch.uint8) ^ _U8_ZERO_POINT
            return torch.ops.moeserve.u8_packed_mm(xu, self.packed, self.scale, self.zero_points)
        return _int8_packed_mm(xq, self.packed, self.scale, self.zero_points)


def _int8_packed_mm(xq: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zero_points: torch.Tensor) -> torch.Tensor:
    return _u8_packed_mm(xq.view(torch.uint8) ^ _U8_ZERO_POINT, packed, scale, zero_points)


def _u8_packed_mm(xu: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  zero_points: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """_int8_packed_mm of activations already flipped to uint8 (xq ^ 128): callers with many GEMMs over
    slices of one activation tensor (the routed experts) flip it once. `dtype`: the output's (oneDNN rounds
    its float32 (xq @ w.T) * scale once, to nearest even, as .to(dtype) does)."""
    # With AMX one row goes in as two: oneDNN's single-row AMX path has a cliff at some shapes (K = 256:
    # 100-200x slower than two rows, measured on torch 2.13); two rows take its GEMM kernel. VNNI has none.
    one_row = xu.shape[0] == 1 and _cpu_int8_unit() == "amx"
    x = xu.expand(2, -1) if one_row else xu  # a stride-0 view: oneDNN reads the row twice, nothing is copied
    y = torch.ops.onednn.qlinear_pointwise(x, 1.0, _U8_ZERO_POINT, packed, scale, zero_points, None, 1.0, 0,
                                           dtype, "none", [], "")
    return y[:1] if one_row else y


def _int8_out_shape(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *rest) -> torch.Tensor:
    return x.new_empty(x.shape[0], scale.numel(), dtype=torch.float32)


# The activations come flipped to uint8 already: the graph fuses the flip into its quantization kernel
@define_op("u8_packed_mm", "(Tensor xu, Tensor packed, Tensor scale, Tensor zero_points) -> Tensor", _int8_out_shape)
def _u8_packed_mm_op(xu: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     zero_points: torch.Tensor) -> torch.Tensor:
    return _u8_packed_mm(xu, packed, scale, zero_points)


def _zen_int8_shape(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], scale.numel())


@define_op("zen_int8_linear", "(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor", _zen_int8_shape)
def _zen_int8_linear_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return zen.int8_linear(x, packed, scale, bias)


def zen_int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] BF16 through zentorch's dynamic-quantization INT8 linear (zen.int8_linear); an op of ours in
    a compiled graph (dynamo does not trace zentorch's ops)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if torch.compiler.is_compiling():
        y = torch.ops.moeserve.zen_int8_linear(x2, packed, scale, bias)
    else:
        y = zen.int8_linear(x2, packed, scale, bias)
    return y.view(*x.shape[:-1], scale.numel())


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
    def process_weights_after_loading(layer: nn.Module) -> None:
        """Pack the loaded weight once (plain attributes, not parameters: the state dict and the loader keep
        seeing weight / weight_scale): for zentorch's INT8 linear where it runs and the model is BF16
        (weight_zen; 1.4-3x faster than the oneDNN path at 1-32 rows over the bench model's shapes,
        benchmarks/packed_linear.py --int8) and / or for vLLM's INT8 GEMM (weight_amx: layers/amx_linear.py;
        where both run, apply() takes it up to amx_linear.SMALL_ROWS rows and zentorch's above), each taking the
        per-channel scales as one float32 vector (weight_scale_vector); else for oneDNN (weight_packed)."""
        layer.weight_zen = layer.weight_scale_vector = layer.weight_packed = layer.weight_amx = None
        bf16 = getattr(layer, "orig_dtype", None) == torch.bfloat16
        if bf16 and zen.usable_int8_linear(layer.weight.data):
            layer.weight_zen = zen.pack_int8_linear(layer.weight.data)
        if bf16 and amx_linear.usable(layer.weight.data):
            layer.weight_amx = cpu_kernels.vnni_pack(layer.weight.data)
        if layer.weight_zen is None and layer.weight_amx is None:
            layer.weight_packed = Int8Packed.of(layer.weight.data, layer.weight_scale.data)
            return
        layer.weight_scale_vector = layer.weight_scale.data.reshape(-1).float().contiguous()

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        few = x.numel() <= amx_linear.SMALL_ROWS * x.shape[-1]  # static in a compiled bucket
        library, packed = getattr(layer, "weight_amx", None), getattr(layer, "weight_zen", None)
        if library is not None and x.dtype == torch.bfloat16 and (few or packed is None):
            return amx_linear.int8_linear(x, library, layer.weight_scale_vector, layer.bias)
        if packed is not None and x.dtype == torch.bfloat16 and x.numel() > 0:  # zentorch fails on no rows
            return zen_int8_linear(x, packed, layer.weight_scale_vector, layer.bias)
        return int8_linear(x, layer.weight, layer.weight_scale, layer.bias, getattr(layer, "weight_packed", None))

    @staticmethod
    def dequantized_weight(layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, layer.weight_scale, layer.orig_dtype)


def expert_out_dtype(act_dtype: torch.dtype) -> torch.dtype:
    """The dtype INT8 experts' GEMMs write for activations of act_dtype: BF16 for a BF16 model, as its float
    experts' GEMMs write theirs (half the bytes of float32: an A8W8 prefill of the bench model x1.03-1.17 from
    this alone, the down projection with its 256-long rows being bound by its output), float32 otherwise."""
    return torch.bfloat16 if act_dtype == torch.bfloat16 else torch.float32


class Int8FusedExperts(FusedExperts):
    """Routed experts in A8W8: w13 int8 [E, 2I, H] + w13_scale [E, 2I]; w2 int8 [E, H, I] + w2_scale [E, H].

    Where zentorch's fused MoE runs (layers/moe/zen.py: an AMD CPU with zentorch installed) and the activations
    are BF16 (a BF16 model: `act_dtype`, or BF16 inputs), a layer is one zentorch_fused_moe call in its INT8
    mode: it quantizes each token per row itself (symmetric, as quantize_per_token), grouped INT8 GEMMs with
    the per-channel scales, SwiGLU, the weighted sum; 3.2-4.5x faster per layer than the per-expert path at
    decode batch 1-64, one thread (benchmarks/int8_experts.py; docs/quantization.md). Its weight cache is
    flushed on every load / move / free, as for BF16 experts (zen.flush_cache). On Intel CPUs with AMX and
    vLLM's CPU kernels the same one call per layer runs through vLLM's INT8 fused MoE (layers/moe/amx.py),
    which also quantizes per token inside. Otherwise (float32 models, other CPUs, MOESERVE_ZENTORCH=0 /
    MOESERVE_AMX_MOE=0) rows
    are sorted by expert once; each expert then costs one INT8 GEMM per projection on a contiguous slice,
    while quantization, dequantization and SwiGLU run batched over all rows. A compiled decode graph of few
    (token, expert) pairs traces them instead (gathered_topk), with the same bits.
    """

    # The model's activation dtype (like() sets it; None: decided per call by the input's dtype). A BF16
    # model's rows that arrive in float32 (an INT8 dispatch payload, decoded) take the fused kernel too, as BF16.
    act_dtype: torch.dtype | None = None

    CHECKPOINT_LEAVES = ("weight", "weight_scale")
    # A compiled graph computes up to this many (token, expert) pairs per slot itself (gathered_topk); above
    # it the per-expert GEMMs, one opaque op a layer. Each pair reads its expert's weights on its own, so the
    # reads grow with the pairs where the grouped GEMMs read each busy expert once: on the V3-shaped bench
    # model (64 slots, top-6), Intel Xeon with AMX, decode tok/s gathered / opaque x1.18-1.29 at 6 and 12
    # pairs, x1.07-1.12 at 24, x0.97 at 48 (docs/quantization.md "INT8 experts in the decode graph").
    GATHER_PAIRS_PER_SLOT = 0.5

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
        ex.act_dtype = base.w13.dtype  # the model dtype (the model is built under it)
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

    def process_weights_after_loading(self, fused_kernels: bool = True) -> None:
        """After loading and after every EPLB move: a fused INT8 MoE kernel where one runs (unless
        fused_kernels=False; a float32 model keeps the per-expert path, the kernels take BF16 activations only):
        zentorch's, or vLLM's AMX one over a copy of the weights in its layout; else every expert's two
        projections packed for oneDNN once."""
        self.packed, self.fused, self.fused_weights = None, "", None
        bf16 = fused_kernels and self.act_dtype in (None, torch.bfloat16)
        if bf16 and zen.usable_int8(self.w13):
            # New or moved weights: zentorch's reordered copies are keyed by address, so none made from what
            # these addresses held before may stay; freed experts flush too (layers/moe/zen.py)
            zen.flush_cache()
            if not hasattr(self, "_zen_finalizer"):
                self._zen_finalizer = weakref.finalize(self, zen.flush_cache)
            self.fused = "zentorch"
            return
        if bf16 and amx.usable_int8(self.w13):
            self.fused_weights, self.fused = (cpu_kernels.vnni_pack(self.w13), cpu_kernels.vnni_pack(self.w2)), "amx"
            return
        packs = [(Int8Packed.of(self.w13.data[e], self.w13_scale.data[e]),
                  Int8Packed.of(self.w2.data[e], self.w2_scale.data[e])) for e in range(self.num_local_experts)]
        self.packed = packs if all(a is not None and b is not None for a, b in packs) else None

    def fused_on(self, x: torch.Tensor) -> bool:
        """Whether these activations go through the fused kernel: set up for it, and BF16 (or a BF16 model's)."""
        return bool(self.fused) and (x.dtype == torch.bfloat16 or self.act_dtype == torch.bfloat16)

    def forward_topk(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k] local slots (all here), weights [T, k] float32 -> [T, H] in x.dtype: one
        fused call (an opaque op in a compiled graph), or a row per (token, expert) pair through forward()."""
        if self.fused_on(x) and x.shape[0]:
            if torch.compiler.is_compiling():
                return torch.ops.moeserve.fused_experts(x, expert_ids, weights, self.op_key)  # -> fused_forward
            return self.fused_forward(x, expert_ids, weights)
        if torch.compiler.is_compiling():
            if self.traceable(expert_ids.numel()):
                return self.gathered_topk(x, expert_ids, weights)
            return self.topk_as_rows(x, expert_ids, weights)
        t, k = expert_ids.shape
        ids, w = expert_ids.reshape(-1), weights.reshape(-1)
        y, y_scale, rows = self._gemms(x, ids, k)
        if expert_epilogue.enabled_for(rows.numel()):  # weighting, token order and the sum over k in one kernel
            return expert_epilogue.combine(y, (y_scale * w[rows, None]).view(-1), rows, t, k, x.dtype)
        return self._placed(x, y, y_scale, rows, w).view(t, k, x.shape[1]).sum(dim=1)

    def traceable(self, pairs: int) -> bool:
        """Whether a compiled graph computes these (token, expert) pairs itself (gathered_topk) rather than
        through the per-expert GEMMs in an opaque op: not where a fused kernel runs the layer, up to
        GATHER_PAIRS_PER_SLOT pairs per slot, and only where the graph's SwiGLU has the eager bits."""
        return (not self.fused and pairs <= self.GATHER_PAIRS_PER_SLOT * self.num_local_experts
                and expert_epilogue.swiglu_bits_match(self.intermediate))

    def gathered_topk(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward_topk traced into a compiled decode graph, with the eager path's bits: each (token, expert) pair
        is a matrix-vector product against its expert's INT8 weights, gathered inside the reduction (inductor
        fuses w[ids] into the loop: no weight copy), exact as the INT32 GEMMs are (int8_rows_dot), each GEMM's
        output rounded to expert_out_dtype as oneDNN writes it, then the eager epilogue's steps in its order. No
        host sync and no call per expert: the opaque op's grouping, slicing and ~12 oneDNN calls a layer at
        batch 1 cost more than the weights they read."""
        t, k = expert_ids.shape
        ids, w = expert_ids.reshape(-1), weights.reshape(-1)
        tq, ts = quantize_per_token(x)  # per token, as the eager path quantizes each token once
        xq = stored(tq)[:, None, :].expand(t, k, -1).reshape(t * k, -1)  # pair i is token i // k
        xs = ts.repeat_interleave(k, dim=0)
        dtype = expert_out_dtype(x.dtype)  # each GEMM's output rounded to it, as oneDNN's epilogue gives it
        h = (int8_rows_dot(xq, self.w13[ids]) * self.w13_scale[ids]).to(dtype)  # [P, 2I]
        aq, a_s = expert_epilogue.swiglu_quant_traceable(h, xs, self.intermediate)
        y = (int8_rows_dot(stored(aq), self.w2[ids]) * self.w2_scale[ids]).to(dtype)  # [P, H]
        pairs = (y * (a_s * w[:, None])).to(x.dtype).view(t, k, -1)  # weighted, rounded per pair as _placed
        total = pairs[:, 0].float()  # summed in pair order, as the eager sum over k
        for j in range(1, k):
            total = total + pairs[:, j].float()
        return total.to(x.dtype)

    def fused_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward_topk through the INT8 fused MoE, zentorch's or amx's (BF16 in and out; x.dtype returned)."""
        if self.fused == "amx":
            y = amx.fused_moe_int8(x.to(torch.bfloat16), *self.fused_weights, self.w13_scale, self.w2_scale,
                                   expert_ids, weights)
            return y.to(x.dtype)
        y = zen.fused_moe_int8(x.to(torch.bfloat16), self.w13, self.w2, self.w13_scale, self.w2_scale,
                               expert_ids, weights)
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same contract as FusedExperts.forward: x [N, H], expert_ids [N] (-1 skipped), weights [N]."""
        assert x.dim() == 2 and expert_ids.shape == weights.shape == (x.shape[0],)
        if self.fused_on(x) and x.shape[0]:  # each row its own token with k = 1; rows of other ranks 0
            if torch.compiler.is_compiling():
                return torch.ops.moeserve.fused_rows(x, expert_ids, weights, self.op_key)
            return self.fused_rows(x, expert_ids, weights)
        return self._rows(x, expert_ids, weights)

    def _rows(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward's rows: x [N, H], one row per (token, expert) pair."""
        y, y_scale, rows = self._gemms(x, expert_ids)
        return self._placed(x, y, y_scale, rows, weights)

    @staticmethod
    def _placed(x: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor, rows: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """_gemms' outputs scaled, weighted and put back in pair order, [N, H] in x.dtype; rows not ours 0."""
        out = x.new_zeros(weights.shape[0], x.shape[1])
        if rows.numel():
            out[rows] = y.mul_(y_scale * weights[rows, None]).to(x.dtype)
        return out

    def _gemms(self, x: torch.Tensor, expert_ids: torch.Tensor,
               k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts over our rows, grouped by expert: (y [R, H] before its activation scale, that scale
        [R, 1] float32, rows [R] the pair each row of y belongs to). With k, x holds the tokens and pair i is
        token i // k: each token is quantized once, not once per expert it routes to, and no repeated copy of
        the tokens is made. Each GEMM's weight-scaled output comes in expert_out_dtype, as a float expert's GEMM
        gives it in the model's dtype; the activation scales and SwiGLU then work in float32."""
        # The one host sync of the INT8 path: no maintained grouped INT8 GEMM runs on CPU (torch._grouped_mm
        # takes float types only), so each busy expert is one oneDNN call on its slice of rows.
        rows, bounds = grouped_on_host(expert_ids, self.num_local_experts)  # [R] our rows, grouped by expert
        dtype = expert_out_dtype(x.dtype)
        if rows.numel() == 0:
            return x.new_empty(0, x.shape[1], dtype=dtype), x.new_empty(0, 1, dtype=torch.float32), rows
        ids = expert_ids[rows]  # [R]
        packed = getattr(self, "packed", None)
        # Rows gathered by index_select (a row copy): indexing (x[rows]) gathers int8 rows ~11x slower here
        # (3.3 vs 0.29 ms for 6144 of [1024, 1024]), BF16 rows 3x
        xu = None  # the rows as the packed GEMMs take them: uint8, flipped before the gather (T rows, not R)
        if k is None:
            xq, xs = quantize_per_token(x.index_select(0, rows))  # [R, H] int8, [R, 1]
        else:  # per-token quantization is row by row: the same bits for a token whichever rows surround it
            tq, ts = quantize_per_token(x)
            tokens = rows // k
            xs = ts.index_select(0, tokens)
            if packed is not None:
                xq, xu = None, (tq.view(torch.uint8) ^ _U8_ZERO_POINT).index_select(0, tokens)
            else:
                xq = tq.index_select(0, tokens)
        h = self._grouped_mm(xq, self.w13, self.w13_scale, bounds, packed, 0, ids, xu, dtype)  # [R, 2I]
        if expert_epilogue.swiglu_quant_for(rows.numel(), self.intermediate):  # scale, SwiGLU, quantization: one kernel
            aq, a_s = expert_epilogue.swiglu_quant(h, xs, self.intermediate)
        else:
            gate, up = (h * xs).split(self.intermediate, dim=-1)  # float32, as swiglu_quant computes it
            aq, a_s = quantize_per_token(F.silu(gate) * up)  # [R, I] int8, [R, 1]
        return self._grouped_mm(aq, self.w2, self.w2_scale, bounds, packed, 1, ids, None, dtype), a_s, rows

    @staticmethod
    def _grouped_mm(aq: torch.Tensor | None, w: torch.Tensor, scale: torch.Tensor, bounds: list[int], packed,
                    proj: int, ids: torch.Tensor, au: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """aq [R, K] int8 grouped by expert (rows bounds[e]..bounds[e+1]), w [E, N, K] int8, scale [E, N]
        -> [R, N] in dtype = (aq @ w[e].T) * scale[e] per group, in float32 and rounded once. With packed
        copies the rows may come as au instead, already flipped to uint8 (aq ^ 128), and aq None."""
        if packed is None:
            acc = torch.empty(aq.shape[0], w.shape[1], dtype=torch.int32, device=aq.device)
            for e in range(len(bounds) - 1):
                if bounds[e + 1] > bounds[e]:
                    int8_mm(aq[bounds[e]:bounds[e + 1]], w[e], out=acc[bounds[e]:bounds[e + 1]])
            return acc.float().mul_(scale[ids]).to(dtype)
        # A GEMM per busy expert (~120 a layer at batch 32 over 64 experts): the activations are flipped to
        # uint8 once for all of them
        if au is None:
            au = aq.view(torch.uint8) ^ _U8_ZERO_POINT
        out = torch.empty(au.shape[0], w.shape[1], dtype=dtype, device=au.device)
        for e in range(len(bounds) - 1):
            lo, hi = bounds[e], bounds[e + 1]
            if hi == lo:
                continue
            p = packed[e][proj]
            if p.pays(hi - lo):
                out[lo:hi] = _u8_packed_mm(au[lo:hi], p.packed, p.scale, p.zero_points, dtype)
            else:
                rows = aq[lo:hi] if aq is not None else (au[lo:hi] ^ _U8_ZERO_POINT).view(torch.int8)
                out[lo:hi] = int8_mm(rows, w[e]).float().mul_(scale[e])
        return out
