"""Absorbed MLA decode that reads the paged latent cache in place: vLLM's CPU kernel library's
`decode_attention_cpu` (sgl-kernel's CPU decode attention, loaded by layers/cpu_kernels.py).

mla.py's standard decode gathers each row's whole context from its blocks into a scratch buffer, clears the
stale slots, and runs SDPA over it (kv_dtype.gather_decode_context), once per layer per step. This kernel
takes the cache as it is, [num_blocks * block_size, 1, C + dr] rows (the values: a view of their first C
columns), and a per-token slot table [B, L] (slot = block * block_size + offset), built once per step and
shared by the layers. Each row's H heads are the queries of one KV head, the output [B, H, C] in BF16,
within SDPA's distance of a float32 reference (tests/layers/test_mla_kernel.py). It reads only positions
below each row's length, so stale slots (a failed request's NaN included) need no clearing. Any block size,
head count and latent width (tested: blocks of 1-64, 4 and 16 heads, C + dr of 40 and 576; its MLA kernel
proper, which packs each 256-token piece of the context once for both products, is taken where C + dr = C +
64 as in DeepSeek's models, a generic grouped kernel otherwise). Its index tensors must be int64.

The kernel walks the heads in blocks whose size it picks from the number of sequences: 6 heads for one, 11
for 2-16, 22 for more, re-reading and re-packing each row's context once per head block. With one thread,
fewer than PAD_ROWS rows are padded to PAD_ROWS with empty (length 0) rows, so that 16 heads are one block:
per row and layer at 128 tokens of context, 22 us instead of 35 (benchmarks/mla_decode.py, docs/engine.md).
With more threads the padding is not applied (the kernel splits its work in contiguous ranges, so the real
rows would land on one thread).

Where it runs (applies()): mla.py's standard decode (not --mla-decode amla), a BF16 query and cache on the
CPU (the kernel has BF16 and FP16 instances only; FP8 caches and float32 models keep the gather + SDPA path),
the library loaded, and at least MIN_SLOTS context slots in the batch (rows x the longest row's blocks x block
size; below, a row or two of short contexts, gather + SDPA is as fast and the padding costs more than it
saves). MOESERVE_MLA_KERNEL=0 switches it off.

The library's other paged MLA decode, `mla_decode_kvcache` (vLLM's reference CPU backend: block size 16
only), measured at x0.41-0.80 of the gather + SDPA path's speed here; benchmarks/mla_decode.py runs both
(docs/engine.md, "MLA decode over the paged cache in place").
"""
from __future__ import annotations

import os

import torch

from moeserve.layers import cpu_kernels

ENV = "MOESERVE_MLA_KERNEL"
OP = "decode_attention_cpu"
PAD_ROWS = 17  # sequences from which the kernel takes 22 heads per block (one thread: fewer are padded)
MIN_SLOTS = 1024


def available() -> bool:
    """The switch is on and the library has the kernel (checked per call: tests flip the switch)."""
    return os.environ.get(ENV, "1") != "0" and cpu_kernels.has(OP)


def applies(q_full: torch.Tensor, cache: torch.Tensor, d) -> bool:
    """Whether decode_latent takes this step's decode, d its DecodeBatch (see the module docstring)."""
    return (d.block_table.numel() * cache.shape[1] >= MIN_SLOTS and q_full.dtype == torch.bfloat16
            and cache.dtype == torch.bfloat16 and cache.device.type == "cpu" and cache.is_contiguous()
            and available())


def num_kv_splits(rows: int) -> int:
    """Each row's context in this many pieces (combined by the kernel's second pass): enough pieces for the
    threads when there are fewer rows than threads (with 2 threads, 1 row x 128 / 1024 context: 0.055 /
    0.186 ms against 0.100 / 0.231 unsplit); one otherwise, where more only adds the combine."""
    return max(1, torch.get_num_threads() // rows)


def kernel_rows(rows: int) -> int:
    """The sequences the kernel is given for `rows` decode rows: PAD_ROWS at least with one thread."""
    return max(rows, PAD_ROWS) if torch.get_num_threads() == 1 else rows


def _indices(d, block_size: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's slot table [n, L], row ids [n] and lengths [n] (int64; rows past d's are empty)."""
    b = d.block_table.shape[0]
    offsets = torch.arange(block_size, dtype=d.block_table.dtype)
    slots = (d.block_table[:, :, None] * block_size + offsets).view(b, -1)
    lens = d.ctx_lens.to(torch.int64)
    if n > b:  # padding rows: length 0, they read nothing
        lens = torch.cat([lens, lens.new_zeros(n - b)])
    return slots, torch.arange(n).clamp_(max=b - 1), lens


def decode_latent(q_full: torch.Tensor, cache: torch.Tensor, d, scale: float, value_dim: int) -> torch.Tensor:
    """q_full [B, H, C + dr] (absorbed query and rope part), cache [num_blocks, block_size, C + dr], d the
    step's DecodeBatch -> the latent output [B, H, value_dim] (value_dim = C: the values are the cache rows'
    first C columns)."""
    b, h, width = q_full.shape
    n = kernel_rows(b)
    slots, row_ids, lens = d.per_step(("mla_kernel", cache.shape[1], n),
                                      lambda: _indices(d, cache.shape[1], n))
    if n > b:
        q = q_full.new_zeros(n, h, width)
        q[:b] = q_full
    else:
        q = q_full.contiguous()
    rows = cache.view(-1, 1, width)  # one KV head per slot
    out = q.new_empty(n, h, value_dim)
    splits = num_kv_splits(n)
    partial = torch.empty(n, h, splits, value_dim + 1, dtype=torch.float32)  # per split: output and its lse
    torch.ops._C.decode_attention_cpu(q, rows, rows[..., :value_dim], out, None, None, None, partial, slots,
                                      row_ids, lens, scale, 0.0, False, 0, None, None)
    return out[:b]
