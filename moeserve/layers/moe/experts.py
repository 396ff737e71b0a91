"""Routed experts of one MoE layer, stored stacked: w13 [E_local, 2*I, H] (gate; up) and w2 [E_local, H, I].

With TP-sharded experts (no expert parallelism, several ranks) each rank holds the slice
[shard_rank * I, (shard_rank + 1) * I) of every expert's intermediate dim and produces partial sums that
the allgather dispatcher adds up by reduce-scatter (SwiGLU is elementwise over the intermediate dim).
"""
from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers import opaque
from moeserve.layers.opaque import define_op
from moeserve.layers.linear import pack_weight
from moeserve.layers.moe import amx, expert_epilogue, zen

logger = logging.getLogger(__name__)


def expert_packing_enabled() -> bool:
    """MOESERVE_PACK_EXPERTS=0 keeps one copy of the routed experts (no oneDNN-packed second copy)."""
    return os.environ.get("MOESERVE_PACK_EXPERTS", "1") != "0"


class FusedExperts(nn.Module):
    CHECKPOINT_LEAVES = ("weight",)  # per expert projection, what a checkpoint must provide
    # A compiled graph gathers each row's expert weights (gathered_forward) up to this many rows per slot,
    # above it GEMMs per expert. On an AMD EPYC (AVX-512, no AMX) the crossover was ~2.5 rows per slot
    # (benchmarks/packed_experts.py --gathered, 64 slots, 1 thread). On an Intel Xeon with AMX the packed
    # GEMMs won in the engine at every batch (V3-shaped checkpoint, batch 1 / 2 / 4 decode tok/s, two runs
    # each: gathered up to 0.5 rows per slot 30.0, 29.1 / 48.9, 47.8 / 66.1, 68.9; never 29.5, 31.1 / 50.1,
    # 50.3 / 82.5, 77.4), though the kernel alone on a cold pool favours gathering up to ~24 rows. Again with
    # the activations stored once (stored(); 2026-12-07, benchmarks/expert_gather.py --mode bf16): x1.02 at
    # batch 1, x0.92 at 2, x0.74-0.81 at 4.
    GATHER_ROWS_PER_SLOT = 0 if torch.cpu._is_amx_tile_supported() else 2
    # One fused call runs the whole layer, set by process_weights_after_loading: "zentorch" (layers/moe/zen.py,
    # AMD CPUs) or "amx" (layers/moe/amx.py, vLLM's kernels on Intel CPUs with AMX); "" where none runs
    fused = ""
    # The amx kernels' copies of (w13, w2) in their layout, remade from the stacked weights on every load / move
    fused_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int,
                 slot_experts: list[int] | None = None, shard_rank: int = 0, num_shards: int = 1) -> None:
        super().__init__()
        assert intermediate % num_shards == 0, "callers validate the intermediate split (placement.build_plan)"
        intermediate //= num_shards
        self.shard_rank, self.num_shards = shard_rank, num_shards
        self.num_local_experts, self.intermediate = num_local_experts, intermediate
        # slot_experts[s] = logical expert whose weights local slot s holds (identity when all are here)
        self.slot_experts = list(range(num_local_experts)) if slot_experts is None else list(slot_experts)
        assert len(self.slot_experts) == num_local_experts
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, intermediate))
        # Per slot (w13, w2) in oneDNN's blocked layout, or None: see process_weights_after_loading
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.op_key = opaque.register(self)

    def traceable(self, pairs: int) -> bool:
        """Whether a compiled decode graph can trace these experts over `pairs` (token, expert) rows: float
        experts can (torch._grouped_mm or the gathered rows, no host sync; packed and fused calls are ops
        of their own inside the graph); subclasses say where they cannot."""
        return True

    def slots_of(self, expert: int) -> list[int]:
        """Local slots holding logical `expert` (empty when another rank holds it)."""
        return [s for s, e in enumerate(self.slot_experts) if e == expert]

    def held_experts(self) -> set[int]:
        return set(self.slot_experts)

    def expert_weight(self, slot: int, proj: str) -> torch.Tensor:
        """View of one expert's gate_proj / up_proj [I, H] or down_proj [H, I] rows in the stacked tensors."""
        if proj == "down_proj":
            return self.w2[slot]
        return self.w13[slot, : self.intermediate] if proj == "gate_proj" else self.w13[slot, self.intermediate:]

    def load_expert(self, slot: int, proj: str, leaf: str, tensor: torch.Tensor, name: str) -> list[str]:
        """Copy checkpoint tensor `name` (leaf 'weight') into `slot`; returns the leaves filled."""
        if leaf != "weight" or tensor.dtype == torch.int8:
            raise ValueError(f"tensor {name} is quantized (INT8); load this checkpoint with --quantization a8w8")
        dst = self.expert_weight(slot, proj)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        return ["weight"]

    def shard(self, proj: str, tensor: torch.Tensor, leaf: str = "weight") -> torch.Tensor:
        """This rank's part of a checkpoint tensor when TP-sharded: gate/up rows (and their per-row
        scales), down_proj columns (its per-row scales are whole)."""
        if self.num_shards == 1:
            return tensor
        part = slice(self.shard_rank * self.intermediate, (self.shard_rank + 1) * self.intermediate)
        if proj == "down_proj":
            return tensor[:, part] if leaf == "weight" else tensor
        return tensor[part]

    def process_weights_after_loading(self, fused_kernels: bool = True) -> None:
        """BF16 experts on CPU, after loading and after every EPLB move, unless fused_kernels=False: one fused
        call per layer, zentorch's (AMD CPUs with zentorch installed: layers/moe/zen.py) or vLLM's AMX kernel
        (Intel CPUs with AMX and vLLM's CPU kernels: layers/moe/amx.py) over a copy of the weights in its layout.
        Otherwise a second copy of every slot's w13 / w2 packed for oneDNN, used for steps with more rows than
        slots (decode at batch >= ~8, prefill). torch._grouped_mm runs one unpacked aten::mm per expert;
        per-expert GEMMs on packed weights measured 1.34x faster for 32 decode tokens (top-6 of 64 experts, 1
        thread) and 1.46x for 8 (benchmarks/packed_experts.py). The stacked weights stay: the compiled graphs'
        few-row path gathers from them, EPLB moves them, and the copies are remade from them. Counted by
        packed_copy_bytes for KV sizing; MOESERVE_PACK_EXPERTS=0 keeps one copy (oneDNN's packs only)."""
        if type(self) is not FusedExperts:
            return
        self.packed, self.fused, self.fused_weights = None, "", None
        if fused_kernels and zen.usable(self.w13):
            # New or moved weights: no copy zentorch reordered from what these addresses held before may stay
            # (it would be used silently). Freed experts flush too, before their memory can hold new weights.
            zen.flush_cache()
            if not hasattr(self, "_zen_finalizer"):
                self._zen_finalizer = weakref.finalize(self, zen.flush_cache)
            self.fused = "zentorch"
            return
        if fused_kernels and amx.usable(self.w13):
            self.fused_weights, self.fused = (amx.pack(self.w13), amx.pack(self.w2)), "amx"
            return
        if not expert_packing_enabled():
            return
        packs = [(pack_weight(self.w13[s]), pack_weight(self.w2[s])) for s in range(self.num_local_experts)]
        self.packed = packs if packs and all(a is not None and b is not None for a, b in packs) else None

    def forward_topk(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] tokens, expert_ids [T, k] local slots (all here), weights [T, k] float32 -> [T, H] the
        weighted sum of each token's experts: one fused call (zentorch or amx), or a row per (token, expert)
        pair through forward()."""
        if self.fused:
            x = x.to(self.w13.dtype)
            if torch.compiler.is_compiling():
                return torch.ops.moeserve.fused_experts(x, expert_ids, weights, self.op_key)
            return self.fused_forward(x, expert_ids, weights)
        if self.packed is not None and not torch.compiler.is_compiling():
            return self._packed_tokens(x.to(self.w13.dtype), expert_ids, weights)
        return self.topk_as_rows(x, expert_ids, weights)

    def topk_as_rows(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward_topk through forward(): a row per (token, expert) pair, summed per token."""
        t, k = expert_ids.shape
        rows = x.repeat_interleave(k, dim=0)  # [T*k, H], row t*k+j is token t for its j-th expert
        return self(rows, expert_ids.reshape(-1), weights.reshape(-1)).view(t, k, x.shape[1]).sum(dim=1)

    def fused_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward_topk through the fused kernel (eager; a compiled graph calls it as one opaque op)."""
        if self.fused == "amx":
            return amx.fused_moe(x, *self.fused_weights, expert_ids, weights)
        return zen.fused_moe(x, self.w13, self.w2, expert_ids, weights)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted expert outputs summed per token.

        x [N, H] rows to compute (one per (token, expert) pair, or tokens repeated);
        expert_ids [N] local expert of each row (-1 = not ours, skipped); weights [N] float32.
        Returns [N, H] in x.dtype, each row weighted by its routing weight.
        """
        assert x.dim() == 2 and expert_ids.shape == weights.shape == (x.shape[0],)
        x = x.to(self.w13.dtype)  # e.g. float32 rows decoded from an INT8 dispatch payload
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        compiling = torch.compiler.is_compiling()
        if self.fused:  # rows of other ranks (-1) are left out, not sent through the kernel
            if compiling:
                return torch.ops.moeserve.fused_rows(x, expert_ids, weights, self.op_key)
            return self.fused_rows(x, expert_ids, weights)
        if compiling and x.shape[0] <= self.GATHER_ROWS_PER_SLOT * self.num_local_experts:
            return self.gathered_forward(x, expert_ids, weights)
        if self.packed is not None:  # a host sync for the group bounds: an opaque op in a compiled graph
            if compiling:
                return torch.ops.moeserve.packed_experts(x, expert_ids, weights, self.op_key)
            return self.packed_forward(x, expert_ids, weights)
        order, offs, valid = group_rows(expert_ids, self.num_local_experts)
        y = self.grouped_forward(x.index_select(0, order), offs)  # [N, H], rows past offs[-1] undefined
        return self._weighted(x, y, order, valid, weights)

    def fused_rows(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward() through the fused kernel: each row its own token with one expert (k = 1); rows not ours 0."""
        mine = (expert_ids >= 0).nonzero().squeeze(1)
        if mine.numel() == x.shape[0]:
            return self.fused_forward(x, expert_ids[:, None], weights[:, None])
        out = torch.zeros_like(x)
        if mine.numel():
            out[mine] = self.fused_forward(x[mine], expert_ids[mine, None], weights[mine, None])
        return out

    def packed_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward() over the oneDNN-packed copies: one GEMM pair per busy expert, the SwiGLU over all rows."""
        return self._packed_rows(x, expert_ids, weights)

    def _packed_rows(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows [N, H] of packed_forward: each row times its weight, in x's row order; rows not ours 0."""
        y, mine = self._packed_gemms(x, expert_ids)
        return _placed(x, y, mine, weights)

    def _packed_tokens(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward_topk over the packed copies: x [T, H] tokens, expert_ids / weights [T, k] -> [T, H]. Each token
        is gathered once per expert it routes to (no k-fold repeat first); at prefill sizes (engines that
        compile) weighting, reordering and the sum over k are one kernel (expert_epilogue.combine)."""
        t, k = expert_ids.shape
        ids, w = expert_ids.reshape(-1), weights.reshape(-1)
        y, mine = self._packed_gemms(x, ids, k)
        if expert_epilogue.enabled_for(mine.numel()):
            return expert_epilogue.combine(y, w[mine], mine, t, k, x.dtype)
        return _placed(x, y, mine, w).view(t, k, x.shape[1]).sum(dim=1)

    def _packed_gemms(self, x: torch.Tensor, expert_ids: torch.Tensor,
                      k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' outputs over the packed copies, unweighted: (y [R, H] in group order, mine [R] the row
        of expert_ids each belongs to); with k, x holds the tokens and row i is token i // k. Only the rows that
        are ours are gathered and computed: each [N, H] pass is a full read and write of the step's
        activations (a prefill's dominant cost besides the GEMMs)."""
        mine, bounds = grouped_on_host(expert_ids, self.num_local_experts)
        busy = [e for e in range(self.num_local_experts) if bounds[e + 1] > bounds[e]]
        if not busy:
            return x.new_empty(0, x.shape[1]), mine
        xs = x.index_select(0, mine if k is None else mine // k)  # 3x faster than x[...] for BF16 rows here
        lin = torch.ops.mkldnn._linear_pointwise  # packed_linear's eager call, without its reshapes
        h = torch.cat([lin(xs[bounds[e]:bounds[e + 1]], self.packed[e][0], None, "none", [], "") for e in busy])
        gate, up = h.split(self.intermediate, dim=-1)
        a = F.silu(gate) * up
        return torch.cat([lin(a[bounds[e]:bounds[e + 1]], self.packed[e][1], None, "none", [], "")
                          for e in busy]), mine

    @staticmethod
    def _weighted(x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, valid: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """y [N, H] (rows in group order) weighted and put back in x's row order; rows not ours 0."""
        w = torch.where(valid, weights[order], 0.0)[:, None]
        out = torch.empty_like(x)
        out[order] = torch.where(valid[:, None], y.float() * w, 0.0).to(x.dtype)
        return out

    def grouped_forward(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """SwiGLU experts over rows grouped by expert: expert e takes rows [offs[e-1], offs[e]).

        torch._grouped_mm runs one GEMM per group over exactly its rows (empty groups cost nothing), with no
        host synchronisation and no Python loop; the stacked weights are used in place, transposed views."""
        mm = _grouped_mm_op if torch.compiler.is_compiling() and xs.dtype != torch.bfloat16 else torch._grouped_mm
        h = mm(xs, self.w13.transpose(1, 2), offs=offs)  # [N, 2I]
        gate, up = h.split(self.intermediate, dim=-1)
        return mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)  # [N, H]

    def gathered_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Few rows (a small decode batch): one matrix-vector product per row against its expert's weights,
        written so that inductor fuses the weight gather into the reduction. Each row reads its expert's
        weights once, with no per-expert GEMM call: measured 19 GB/s against torch._grouped_mm's 8 GB/s for 6
        rows over 64 experts (cold weights, 1 thread). Compiled graphs only (eager, w[ids] would copy)."""
        ids = expert_ids.clamp(min=0)
        h = (stored(x)[:, None, :].float() * self.w13[ids].float()).sum(-1).to(x.dtype)  # [N, 2I]
        gate, up = h.split(self.intermediate, dim=-1)
        a = stored(F.silu(gate) * up)
        y = (a[:, None, :].float() * self.w2[ids].float()).sum(-1)  # [N, H]
        return torch.where((expert_ids >= 0)[:, None], y * weights[:, None], 0.0).to(x.dtype)


def stored(t: torch.Tensor) -> torch.Tensor:
    """t itself, as a buffer of its own in an inductor graph (as_strided's lowering stores its input).
    Inductor otherwise inlines a pointwise producer into every consumer's loop: an activation (a norm, a
    quantization, SwiGLU) feeding a matrix-vector product over gathered weights was recomputed once per
    output element (the INT8 experts' first traced version: x0.90 in the engine)."""
    return t.as_strided(t.shape, t.stride())


def _placed(x: torch.Tensor, y: torch.Tensor, mine: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [R, H] (rows mine of N, in group order) times their weights, put back in row order [N, H]; others 0."""
    out = x.new_zeros(weights.shape[0], x.shape[1])
    if mine.numel():
        out[mine] = _times_weights(y, weights[mine])
    return out


def _times_weights(y: torch.Tensor, weights: torch.Tensor, block: int = 128) -> torch.Tensor:
    """y [M, H] rows times their float32 routing weights [M], in place, with the bits of
    (y.float() * w).to(y.dtype): float32 product, rounded once. In blocks of rows, so the float32 copy stays
    in cache: 2.7 ms for 6144 x 1024 BF16 rows here, against 5.2 ms whole and 19.6 ms for
    torch.mul(y, w, out=y), whose mixed-dtype kernel is slow on large inputs (1 thread)."""
    for rows, w in zip(y.split(block), weights.split(block)):
        rows.copy_(rows.float().mul_(w[:, None]))
    return y


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@define_op("grouped_mm", "(Tensor a, Tensor b, Tensor offs) -> Tensor", _grouped_mm_shape)
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm for a compiled graph in float32: the CPU kernel takes it, but the op's shape function
    (written for CUDA) rejects everything but BF16 at trace time."""
    return torch._grouped_mm(a, b, offs=offs)


# Rows up to which grouped_on_host sorts on the host: a decode step's few rows cost ~80 us through
# group_rows' tensor ops plus the bounds' host sync, ~10 us as Python lists; prefill's thousands of rows sort
# faster as tensors.
HOST_GROUP_MAX_ROWS = 256


def grouped_on_host(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Rows grouped by expert for the paths that loop over experts on the host: (mine [R] the rows that are
    ours (expert id >= 0) in group order, stable within a group; bounds [E + 1], expert e's rows being
    mine[bounds[e]:bounds[e + 1]]). The same order as group_rows."""
    if expert_ids.numel() > HOST_GROUP_MAX_ROWS:
        order, offs, _ = group_rows(expert_ids, num_experts)
        bounds = [0] + offs.tolist()
        return order[: bounds[-1]], bounds  # rows of other ranks (-1) sort last
    ids = expert_ids.tolist()
    mine = sorted((i for i, e in enumerate(ids) if e >= 0), key=ids.__getitem__)  # Python's sort is stable
    bounds = [0] * (num_experts + 1)
    for i in mine:
        bounds[ids[i] + 1] += 1
    for e in range(num_experts):
        bounds[e + 1] += bounds[e]
    return torch.tensor(mine, dtype=torch.long, device=expert_ids.device), bounds


def group_rows(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, as tensor ops (no host sync): (order [N] the rows in group order, offs [E]
    int32 end offset of each expert's group, valid [N] whether row order[i] is ours). Rows of other ranks
    (-1) sort after every group, so no GEMM touches them."""
    key = torch.where(expert_ids < 0, num_experts, expert_ids)
    order = key.argsort(stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))
    offs = counts[:num_experts].cumsum(0).to(torch.int32)
    return order, offs, key[order] < num_experts
