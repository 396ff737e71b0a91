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
- experts through a fused MoE kernel, zentorch's (layers/moe/zen.py) or vLLM's AMX one (layers/moe/amx.py),
  one call per layer at every bucket;
- with tensor parallelism: attention's all-reduce over the TP group, and the whole MoE block (each TP rank
  takes its share of the rows, the group gathers the outputs back: host-side sizes).
Each is registered as an op of the `moeserve` library (define_op) taking tensors plus the integer key of the
module that runs it; eager code calls the module directly (no op dispatch cost), the graph calls the op.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch

_LIB = torch.library.Library("moeserve", "FRAGMENT")


def define_op(name: str, schema: str, fake: Callable) -> Callable:
    """Decorator: `impl` becomes torch.ops.moeserve.<name> (what the decorated name then holds), an op a
    compiled graph calls as one opaque kernel, with `fake` giving its output's shape at trace time. The op must not return (a view of) an input, and
    what it writes elsewhere (the KV cache) is not declared: no graph reads it back.

    A plain library op (one Python kernel for every backend, oneDNN's packed tensors included) rather than
    torch.library.custom_op: the graph's call costs ~16 us less (custom_op's Python wrapper layers; a compiled
    per-token quantization + INT8 GEMM of [64 x 64] at 2 rows, one thread: 82 against 66 us), and a decode step
    of the bench model makes ~60 such calls."""
    def register(impl: Callable) -> Callable:
        _LIB.define(name + schema)
        _LIB.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"moeserve::{name}", fake, lib=_LIB)
        return getattr(torch.ops.moeserve, name)  # the op: a graph that calls it keeps it whole
    return register


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


def _rows_like_first(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(x)


def _mla_shape(q_nope: torch.Tensor, q_pe: torch.Tensor, new_kv: torch.Tensor, w_uv_t: torch.Tensor,
               key: torch.Tensor) -> torch.Tensor:
    return q_nope.new_empty(q_nope.shape[0], w_uv_t.shape[0] * w_uv_t.shape[2])


@define_op("mla_attention", "(Tensor q_nope, Tensor q_pe, Tensor new_kv, Tensor w_uv_t, Tensor key) -> Tensor",
           _mla_shape)
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, new_kv: torch.Tensor, w_uv_t: torch.Tensor,
                  key: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), new_kv [T, C + dr], w_uv_t [H, C, dv] the layer's
    absorbed value projection (its shape gives the output's) -> [T, H * dv]: MLAttention.attend_cached
    (it writes the cache, which nothing in the graph reads: no declared mutation)."""
    return _module(key).attend_cached(q_nope, q_pe, new_kv)


@define_op("moe_routed", "(Tensor rows, Tensor weights, Tensor expert_ids, Tensor key) -> Tensor", _rows_like_first)
def moe_routed(rows: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """rows [T, H], routing weights / the router's logical experts [T, k] -> [T, H]: MoE.routed_eager (load
    recording, the expert map, dispatch, experts, combine; with the shared experts inside when a transfer is
    in flight to hide them under)."""
    return _module(key).routed_eager(rows, weights, expert_ids)


@define_op("packed_experts", "(Tensor x, Tensor expert_ids, Tensor weights, Tensor key) -> Tensor", _rows_like_first)
def packed_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [N, H], expert_ids / weights [N] -> [N, H]: FusedExperts.packed_forward."""
    return _module(key).packed_forward(x, expert_ids, weights)


@define_op("fused_experts", "(Tensor x, Tensor expert_ids, Tensor weights, Tensor key) -> Tensor", _rows_like_first)
def fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [T, H], expert_ids / weights [T, k] -> [T, H]: the module's fused_forward (zentorch's or amx's fused
    MoE, BF16 or INT8)."""
    return _module(key).fused_forward(x, expert_ids, weights)


@define_op("fused_rows", "(Tensor x, Tensor expert_ids, Tensor weights, Tensor key) -> Tensor", _rows_like_first)
def fused_rows(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [N, H], expert_ids / weights [N] -> [N, H]: FusedExperts.fused_rows (a host sync to leave out rows of
    other ranks)."""
    return _module(key).fused_rows(x, expert_ids, weights)


@define_op("tp_all_reduce", "(Tensor x, Tensor key) -> Tensor", _rows_like_first)
def tp_all_reduce(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x summed over the TP group of the module under `key` (a new tensor: the op owns no input)."""
    return _module(key).tp.all_reduce(x.clone())


@define_op("moe_block", "(Tensor x, Tensor key) -> Tensor", _rows_like_first)
def moe_block(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H]: MoE.eager_block (router, dispatch, experts, combine, shared experts, TP gather)."""
    return _module(key).eager_block(x)
