"""Layer calls that a compiled graph keeps as single opaque ops instead of tracing into them.

The compiled decode graph (engine/compiled_decode.py) fuses everything between these calls. What stays
outside:
- MLA's cache write + attention: it reads the per-step attention metadata (a Scoped value, block tables as
  Python lists for prefills) and loops over prefill sequences;
- routed experts that are not traceable: INT8 experts past a few pairs per slot (one oneDNN GEMM per busy
  expert, so one host sync; fewer pairs are traced, Int8FusedExperts.gathered_topk) and every multi-rank
  dispatcher (collectives with host-side split sizes);
- BF16 experts over their oneDNN-packed copies (FusedExperts.packed_forward: the same host sync), for
  buckets with more rows than expert slots;
- BF16 experts through zentorch's fused MoE (layers/moe/zen.py), one call per layer at every bucket;
- with tensor parallelism: attention's all-reduce over the TP group, and the whole MoE block (each TP rank
  takes its share of the rows, the group gathers the outputs back: host-side sizes).
Each is registered as a torch custom op taking tensors plus the integer key of the module that runs it;
eager code calls the module directly (no op dispatch cost), the graph calls the op.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_MODULES: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


def register(module: torch.nn.Module) -> torch.Tensor:
    """A process-unique key under which the ops below find `module` (held weakly), as a 0-d CPU tensor (a
    plain attribute, not a buffer: models are built on the meta device): a tensor is a graph input where an
    int would be a constant, so one compiled graph serves every layer of a kind."""
    key = next(_NEXT_KEY)
    _MODULES[key] = module
    return torch.tensor(key, device="cpu")


def _module(key: torch.Tensor):
    return _MODULES[int(key)]


@torch.library.custom_op("moeserve::mla_attention", mutates_args=())
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, new_kv: torch.Tensor, w_uv_t: torch.Tensor,
                  key: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), new_kv [T, C + dr], w_uv_t [H, C, dv] the layer's
    absorbed value projection (its shape gives the output's) -> [T, H * dv]: MLAttention.attend_cached
    (it writes the cache, which nothing in the graph reads: no declared mutation)."""
    return _module(key).attend_cached(q_nope, q_pe, new_kv)


@mla_attention.register_fake
def _(q_nope: torch.Tensor, q_pe: torch.Tensor, new_kv: torch.Tensor, w_uv_t: torch.Tensor,
      key: torch.Tensor) -> torch.Tensor:
    return q_nope.new_empty(q_nope.shape[0], w_uv_t.shape[0] * w_uv_t.shape[2])


@torch.library.custom_op("moeserve::moe_routed", mutates_args=())
def moe_routed(rows: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """rows [T, H], routing weights / the router's logical experts [T, k] -> [T, H]: MoE.routed_eager (load
    recording, the expert map, dispatch, experts, combine; with the shared experts inside when a transfer is
    in flight to hide them under)."""
    return _module(key).routed_eager(rows, weights, expert_ids)


@moe_routed.register_fake
def _(rows: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(rows)


@torch.library.custom_op("moeserve::packed_experts", mutates_args=())
def packed_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [N, H], expert_ids / weights [N] -> [N, H]: FusedExperts.packed_forward."""
    return _module(key).packed_forward(x, expert_ids, weights)


@packed_experts.register_fake
def _(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeserve::zen_experts", mutates_args=())
def zen_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [T, H], expert_ids / weights [T, k] -> [T, H]: the module's zen_forward (zentorch's fused MoE, BF16 or INT8)."""
    return _module(key).zen_forward(x, expert_ids, weights)


@zen_experts.register_fake
def _(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeserve::zen_rows", mutates_args=())
def zen_rows(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [N, H], expert_ids / weights [N] -> [N, H]: FusedExperts.zen_rows (a host sync to leave out rows of
    other ranks)."""
    return _module(key).zen_rows(x, expert_ids, weights)


@zen_rows.register_fake
def _(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeserve::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x summed over the TP group of the module under `key` (a new tensor: the op owns no input)."""
    return _module(key).tp.all_reduce(x.clone())


@tp_all_reduce.register_fake
def _(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeserve::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H]: MoE.eager_block (router, dispatch, experts, combine, shared experts, TP gather)."""
    return _module(key).eager_block(x)


@moe_block.register_fake
def _(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
