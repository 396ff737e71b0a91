"""Absorbed MLA decode that reads the paged latent cache in place: vLLM's CPU kernel library's
`decode_attention_cpu` (sgl-kernel's AMX decode attention, loaded by layers/cpu_kernels.py).

mla.py's standard decode gathers each row's whole context from its blocks into a scratch buffer, clears the
stale slots, and runs SDPA over it (kv_dtype.gather_decode_context), once per layer per step. This kernel
takes the cache as it is, [num_blocks * block_size, 1, C + dr] rows (the values: a view of their first C
columns), and a per-token slot table [B, L] (slot = block * block_size + offset, DecodeBatch.token_slots:
built once per step, shared by the layers). Each row's H heads are the queries of one KV head, the output
[B, H, C] in BF16, within SDPA's distance of a float32 reference (tests/layers/test_mla_kernel.py). It reads
only positions below each row's length, so stale slots (a failed request's NaN included) need no clearing.
Any block size, head count and latent width (tested: blocks of 1-64, 1-128 heads, C + dr of 40 and 576;
vLLM's AMX MLA backend, its caller, asks for 576 and blocks of 32k). Its index tensors must be int64.

Where it runs (applies()): mla.py's standard decode (not --mla-decode amla), a BF16 query and cache on the
CPU (the kernel has BF16 and FP16 instances only; FP8 caches and float32 models keep the gather + SDPA path),
the library loaded, a decode batch of at least MIN_ROWS rows and MIN_TOKENS context slots (rows x the
longest row's blocks). MOESERVE_MLA_KERNEL=0 switches it off.

The library's other paged MLA decode, `mla_decode_kvcache` (vLLM's reference CPU backend: block size 16
only), measured 2-2.5x slower than the gather + SDPA path here; benchmarks/mla_decode.py runs both
(docs/engine.md, "MLA decode over the paged cache in place").
"""
from __future__ import annotations

import os

import torch

from moeserve.layers import cpu_kernels

ENV = "MOESERVE_MLA_KERNEL"
OP = "decode_attention_cpu"

# Where the kernel runs: from MIN_ROWS decode rows and MIN_TOKENS context slots (rows x the longest row's
# blocks x block_size). Below, the gather + SDPA path is as fast or faster: benchmarks/mla_decode.py (one
# thread, 16 heads, V3's latent dims), kernel / gather + SDPA per layer: x0.72-0.87 at 1 row x 128-1024
# context, x0.90-1.02 at 4 rows, x0.93 / 1.02 / 1.10 at 8 x 128 / 512 / 1024, x0.92 / 1.18 / 1.23 at 16,
# x1.42 / 1.84 / 1.83 at 32 (docs/engine.md, "MLA decode over the paged cache in place").
MIN_ROWS = 8
MIN_TOKENS = 4096


def available() -> bool:
    """The switch is on and the library has the kernel (checked per call: tests flip the switch)."""
    return os.environ.get(ENV, "1") != "0" and cpu_kernels.has(OP)


def applies(q_full: torch.Tensor, cache: torch.Tensor, d) -> bool:
    """Whether decode_latent takes this step's decode (d: its DecodeBatch; see the module docstring)."""
    rows = q_full.shape[0]
    return (rows >= MIN_ROWS and d.block_table.numel() * cache.shape[1] >= MIN_TOKENS
            and q_full.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16 and cache.device.type == "cpu"
            and cache.is_contiguous() and available())


def num_kv_splits(rows: int) -> int:
    """Each row's context in this many pieces (combined by the kernel's second pass): enough pieces for the
    threads when there are fewer rows than threads (with 2 threads, 1 row x 128 / 1024 context: 0.055 /
    0.186 ms against 0.100 / 0.231 unsplit); one otherwise, where more only adds the combine."""
    return max(1, torch.get_num_threads() // rows)


def decode_latent(q_full: torch.Tensor, cache: torch.Tensor, d, scale: float, value_dim: int) -> torch.Tensor:
    """q_full [B, H, C + dr] (absorbed query and rope part), cache [num_blocks, block_size, C + dr], d the
    step's DecodeBatch -> the latent output [B, H, value_dim] (value_dim = C: the values are the cache rows'
    first C columns)."""
    b, h, width = q_full.shape
    rows = cache.view(-1, 1, width)  # one KV head per slot
    out = q_full.new_empty(b, h, value_dim)
    splits = num_kv_splits(b)
    partial = torch.empty(b, h, splits, value_dim + 1, dtype=torch.float32)  # per split: output and its lse
    torch.ops._C.decode_attention_cpu(
        q_full.contiguous(), rows, rows[..., :value_dim], out, None, None, None, partial,
        d.token_slots(cache.shape[1]), d.row_ids(), d.ctx_lens, scale, 0.0, False, 0, None, None)
    return out
