"""Block FP8 (DeepSeek-V3's layout): float8_e4m3fn weights with one float32 scale per 128x128 block,
stored as `weight_scale_inv` [ceil(out/128), ceil(in/128)] (w ~= q * scale_inv, the checkpoint's name).

The weights stay FP8 in memory (1 byte per weight + 4 bytes per 16384 weights of scales). The GEMM:
- CUDA with FP8 tensor cores (sm89+): torch._scaled_mm per 128-wide K block. Activations are quantized to
  e4m3 with one scale per token and K block (DeepSeek's 1x128 activation tiles); each K block is one
  _scaled_mm with row-wise scales (x_scale[t, kb], w_scale[n, kb]), summed in float32.
- Elsewhere (CPU): the weight is dequantized tile by tile (a few 128-row blocks at a time, at most
  _TILE_BYTES of scratch) into the activation dtype and multiplied there; the model is never held in BF16.
  Routed experts are dequantized one expert at a time.

Plugged in like INT8 (models/quantization.py): a Linear gets Fp8LinearMethod, FusedExperts becomes
Fp8FusedExperts. A float weight arriving from the checkpoint (`--quantization fp8` on a BF16 checkpoint) is
quantized at load to the same layout; an FP8 checkpoint's weight arrives as an Fp8Weight (loader pairs it
with its scale, from whichever shard holds it) and is copied as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.moe.experts import FusedExperts

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
_EPS = 1e-12  # scale floor: an all-zero block quantizes to zeros
_TILE_BYTES = 8 << 20  # CPU path: dequantized scratch per tile


class Fp8LoadError(ValueError):
    """A checkpoint tensor that cannot go into an FP8 parameter; names the tensor."""


@dataclass
class Fp8Weight:
    """A checkpoint FP8 weight with its block scales, as the loader hands it over (not dequantized)."""
    q: torch.Tensor  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(out/128), ceil(in/128)]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_block(self.q, self.scale_inv, dtype)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q e4m3 [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)])."""
    out_f, in_f = w.shape
    rb, cb = blocks(out_f), blocks(in_f)
    padded = F.pad(w.float(), (0, cb * BLOCK - in_f, 0, rb * BLOCK - out_f))
    tiles = padded.view(rb, BLOCK, cb, BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_(min=_EPS)  # [rb, cb]
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rb * BLOCK, cb * BLOCK)[:out_f, :in_f].contiguous(), scale


def expand_scale(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rb, cb] block scales -> [rows, cols] per element (float32)."""
    s = scale_inv.float().repeat_interleave(BLOCK, 0)[:rows]
    return s.repeat_interleave(BLOCK, 1)[:, :cols]


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q e4m3 [out, in] * its block scales -> dtype [out, in]."""
    return (q.float() * expand_scale(scale_inv, *q.shape)).to(dtype)


def _scaled_mm_runs(x: torch.Tensor, q: torch.Tensor) -> bool:
    """FP8 tensor cores: CUDA sm89+, and cuBLASLt's 16-multiples on K (every K block) and N."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    k, n = q.shape[1], q.shape[0]
    return k % 16 == 0 and n % 16 == 0


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, force: str | None = None) -> torch.Tensor:
    """x [M, K] float, q [N, K] e4m3 + block scales -> x @ dequant(q).T, [M, N] in x.dtype.

    force: "scaled_mm" or "tiled" picks the path (tests run both on CPU, where torch._scaled_mm also runs)."""
    path = force or ("scaled_mm" if _scaled_mm_runs(x, q) else "tiled")
    if path == "scaled_mm":
        return _scaled_mm_blocks(x, q, scale_inv).to(x.dtype)
    return _tiled_dequant_mm(x, q, scale_inv)


def _tiled_dequant_mm(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    rows = max(BLOCK, (_TILE_BYTES // max(1, k * x.element_size())) // BLOCK * BLOCK)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    scale = scale_inv.float()
    col_scale = None if k % BLOCK == 0 else scale.repeat_interleave(BLOCK, 1)[:, :k]  # [rb, K], partial blocks
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b0, b1 = r0 // BLOCK, blocks(r1)
        if col_scale is None and (r1 - r0) % BLOCK == 0:  # whole blocks: broadcast the scales, no expansion
            tile = q[r0:r1].to(torch.float32).view(b1 - b0, BLOCK, k // BLOCK, BLOCK)
            tile = tile.mul_(scale[b0:b1, None, :, None]).view(r1 - r0, k)
        else:
            full = col_scale if col_scale is not None else scale.repeat_interleave(BLOCK, 1)
            tile = q[r0:r1].to(torch.float32).mul_(full[b0:b1].repeat_interleave(BLOCK, 0)[: r1 - r0])
        torch.matmul(x, tile.to(x.dtype).t(), out=out[:, r0:r1])  # tile: [rows, K] scratch
    return out


def _scaled_mm_blocks(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Per K block: e4m3 activations (scale per token) x e4m3 weight (scale per output row), float32 sum."""
    m, k = x.shape
    n = q.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    row_scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:n]  # [N, cb]
    xf = x.float()
    for kb, k0 in enumerate(range(0, k, BLOCK)):
        xs = xf[:, k0:k0 + BLOCK]
        x_scale = (xs.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_EPS)  # [M, 1]
        xq = (xs / x_scale).to(FP8_DTYPE)
        w_scale = row_scale[:, kb].contiguous().view(1, n)
        acc += torch._scaled_mm(xq, q[:, k0:k0 + BLOCK].t(), scale_a=x_scale, scale_b=w_scale,
                                out_dtype=torch.bfloat16).float()
    return acc


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float -> [..., N] in x.dtype."""
    lead = x.shape[:-1]
    y = fp8_matmul(x.reshape(-1, x.shape[-1]), q, scale_inv)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.view(*lead, q.shape[0])


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise Fp8LoadError(f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}")
    if src.dtype == torch.int8:
        raise Fp8LoadError(f"tensor {name} is INT8 but its parameter is FP8: load it with --quantization a8w8")
    with torch.no_grad():
        dst.copy_(src)


def _fill(q_dst: torch.Tensor, s_dst: torch.Tensor, tensor, name: str) -> list[str]:
    """One weight into (q, scale_inv): an Fp8Weight as is, a float weight quantized now."""
    if isinstance(tensor, Fp8Weight):
        q, s = tensor.q, tensor.scale_inv.float()
    else:
        if tuple(tensor.shape) != tuple(q_dst.shape):
            raise Fp8LoadError(f"tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                               f"{tuple(q_dst.shape)}")
        if tensor.dtype == torch.int8:
            raise Fp8LoadError(f"tensor {name} is INT8 but its parameter is FP8: load it with --quantization a8w8")
        q, s = quantize_block(tensor)
    _copy_checked(q_dst, q, name)
    _copy_checked(s_dst, s, name + "_scale_inv")
    return ["weight", "weight_scale_inv"]


def tp_slice_fp8(layer: nn.Module, tensor: Fp8Weight) -> Fp8Weight | torch.Tensor:
    """This TP rank's part of an FP8 checkpoint weight: FP8 + its scales when the slice falls on block
    boundaries, else the dequantized float slice (the layer re-quantizes it in its own blocks)."""
    if layer.tp_dim is None or layer.tp_size == 1:
        return tensor
    dim, size = layer.tp_dim, tensor.q.shape[layer.tp_dim] // layer.tp_size
    if size % BLOCK:
        return layer.tp_slice("weight", tensor.dequantize())
    r = layer.tp_rank
    q = tensor.q.narrow(dim, r * size, size)
    return Fp8Weight(q, tensor.scale_inv.narrow(dim, r * size // BLOCK, size // BLOCK))


class Fp8LinearMethod:
    """How a Linear holds and applies block-FP8 weights. Stateless; the tensors live on the layer."""

    takes_fp8 = True  # the loader hands it Fp8Weight as is

    @staticmethod
    def create_weights(layer: nn.Module, float_stays_float: bool = False) -> None:
        """Swap the float weight for e4m3 weight [out, in] + weight_scale_inv [ceil(out/128), ceil(in/128)].

        float_stays_float: the checkpoint is FP8, so a weight it ships in float is one it chose to keep high
        precision; the layer then turns back into a float Linear instead of quantizing it."""
        dev = layer.weight.device
        layer.orig_dtype = layer.weight.dtype
        layer.fp8_float_stays_float = float_stays_float
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=FP8_DTYPE,
                                                device=dev), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(
            torch.empty(blocks(layer.out_features), blocks(layer.in_features), dtype=torch.float32, device=dev),
            requires_grad=False)
        layer.quant_method = Fp8LinearMethod

    @staticmethod
    def load_tensor(layer: nn.Module, leaf: str, tensor, name: str) -> list[str]:
        if leaf == "weight" and layer.fp8_float_stays_float and not isinstance(tensor, Fp8Weight):
            _unquantize(layer, tensor, name)
            return ["weight", "weight_scale_inv"]
        if leaf == "weight":
            return _fill(layer.weight, layer.weight_scale_inv, tensor, name)
        _copy_checked(getattr(layer, leaf), tensor, name)  # bias
        return [leaf]

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias)

    @staticmethod
    def dequantized_weight(layer: nn.Module) -> torch.Tensor:
        return dequantize_block(layer.weight, layer.weight_scale_inv, layer.orig_dtype)


def _unquantize(layer: nn.Module, tensor: torch.Tensor, name: str) -> None:
    """Back to a plain float Linear holding `tensor` (a weight the FP8 checkpoint kept in float)."""
    if tuple(tensor.shape) != tuple(layer.weight.shape):
        raise Fp8LoadError(f"tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                           f"{tuple(layer.weight.shape)}")
    if tensor.dtype == torch.int8:
        raise Fp8LoadError(f"tensor {name} is INT8 in an FP8 checkpoint")
    layer.weight = nn.Parameter(tensor.to(layer.orig_dtype, copy=True), requires_grad=False)
    del layer.weight_scale_inv
    layer.quant_method = None


class Fp8FusedExperts(FusedExperts):
    """Routed experts in block FP8: w13 e4m3 [E, 2I, H] with w13_scale_inv [E, 2*ceil(I/128), ceil(H/128)]
    (gate blocks, then up blocks: each projection is blocked on its own, as in the checkpoint);
    w2 e4m3 [E, H, I] with w2_scale_inv [E, ceil(H/128), ceil(I/128)]."""

    CHECKPOINT_LEAVES = ("weight", "weight_scale_inv")

    def traceable(self, pairs: int) -> bool:
        return False  # a compiled graph keeps them in the routed experts' opaque op

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int,
                 slot_experts: list[int] | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(num_local_experts, hidden, intermediate, slot_experts)
        e, i = num_local_experts, intermediate
        self.compute_dtype = dtype
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden, dtype=FP8_DTYPE), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden, i, dtype=FP8_DTYPE), requires_grad=False)
        self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * blocks(i), blocks(hidden)), requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.empty(e, blocks(hidden), blocks(i)), requires_grad=False)

    @classmethod
    def like(cls, base: FusedExperts) -> "Fp8FusedExperts":
        with torch.device(base.w13.device):
            ex = cls(base.num_local_experts, base.w13.shape[-1], base.intermediate, base.slot_experts,
                     dtype=base.w13.dtype)
        ex.shard_rank, ex.num_shards = base.shard_rank, base.num_shards
        return ex

    def expert_scale(self, slot: int, proj: str) -> torch.Tensor:
        if proj == "down_proj":
            return self.w2_scale_inv[slot]
        nb = blocks(self.intermediate)
        return self.w13_scale_inv[slot, :nb] if proj == "gate_proj" else self.w13_scale_inv[slot, nb:]

    def shard(self, proj: str, tensor, leaf: str = "weight"):
        """TP-sharded experts: the FP8 slice when it falls on block boundaries, else the float slice."""
        if not isinstance(tensor, Fp8Weight) or self.num_shards == 1:
            return super().shard(proj, tensor, leaf)
        i = self.intermediate
        if i % BLOCK:
            return super().shard(proj, tensor.dequantize(), leaf)
        dim = 1 if proj == "down_proj" else 0
        r = self.shard_rank
        return Fp8Weight(tensor.q.narrow(dim, r * i, i), tensor.scale_inv.narrow(dim, r * i // BLOCK, i // BLOCK))

    def load_expert(self, slot: int, proj: str, leaf: str, tensor, name: str) -> list[str]:
        if leaf != "weight":
            raise Fp8LoadError(f"tensor {name} is a {leaf} (INT8 checkpoint); load it with --quantization a8w8")
        return _fill(self.expert_weight(slot, proj), self.expert_scale(slot, proj), tensor, name)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in float32, for references and checks."""
        e = self.num_local_experts
        w13 = torch.stack([torch.cat([dequantize_block(self.expert_weight(s, p), self.expert_scale(s, p))
                                      for p in ("gate_proj", "up_proj")]) for s in range(e)])
        w2 = torch.stack([dequantize_block(self.w2[s], self.w2_scale_inv[s]) for s in range(e)])
        return w13, w2

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same contract as FusedExperts.forward; one expert's weights are dequantized at a time (CPU) or
        multiplied in FP8 (CUDA sm89+)."""
        assert x.dim() == 2 and expert_ids.shape == weights.shape == (x.shape[0],)
        x = x.to(self.compute_dtype)
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        order = expert_ids.argsort(stable=True)
        counts = torch.bincount(expert_ids.clamp(min=-1) + 1, minlength=self.num_local_experts + 1).tolist()
        start = counts[0]  # rows routed elsewhere (-1) sort first
        for e, n in enumerate(counts[1:]):
            if n == 0:
                continue
            rows = order[start:start + n]
            start += n
            xe = x[rows]
            gate = fp8_matmul(xe, self.expert_weight(e, "gate_proj"), self.expert_scale(e, "gate_proj"))
            up = fp8_matmul(xe, self.expert_weight(e, "up_proj"), self.expert_scale(e, "up_proj"))
            y = fp8_matmul(F.silu(gate) * up, self.w2[e], self.w2_scale_inv[e])
            out[rows] = (y.float() * weights[rows, None]).to(x.dtype)
        return out
