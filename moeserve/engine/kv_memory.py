"""The KV pool before it is allocated: how many blocks (num_kv_blocks: --num-kv-blocks, vLLM's
--gpu-memory-utilization as the share of the device's memory left after the weights, --kv-cache-memory, or the
default), and the check that they fit (check_kv_pool, naming the flags). On CPU the device is host RAM;
moeserve/device_memory.py has the device figures.
"""
from __future__ import annotations

import torch

from moeserve.arch import DeepseekArch
from moeserve.config import EngineConfig
from moeserve.device_memory import GiB, check_fits, total_memory

ACTIVATION_RESERVE = 0.05  # of the utilization budget, kept for activations and the sampler
DEFAULT_KV_CACHE_BYTES = 2 << 30  # cap of the default pool; --kv-cache-memory / --num-kv-blocks override


def blocks_for_utilization(utilization: float, weights: int, bytes_per_block: int, device: torch.device,
                           ranks_sharing: int = 1) -> int:
    """--gpu-memory-utilization: KV blocks in utilization x total memory less the weights and a reserve.
    On CPU the ranks of one node share host RAM: each gets its 1/ranks_sharing part."""
    share = ranks_sharing if device.type == "cpu" else 1
    budget = utilization * total_memory(device) / share
    kv = budget * (1 - ACTIVATION_RESERVE) - weights
    if kv < bytes_per_block:
        raise MemoryError(f"--gpu-memory-utilization {utilization} gives {budget / GiB:.2f} GiB of "
                          f"{total_memory(device) / share / GiB:.2f} GiB {device.type} memory per rank, but the weights take "
                          f"{weights / GiB:.2f} GiB and leave no room for one KV block ({bytes_per_block} bytes); "
                          "raise --gpu-memory-utilization or set --kv-cache-memory")
    return int(kv // bytes_per_block)


def num_kv_blocks(config: EngineConfig, arch: DeepseekArch, dtype: torch.dtype, weights: int = 0,
                  device: torch.device = torch.device("cpu")) -> int:
    """The KV pool's blocks: --num-kv-blocks, else --gpu-memory-utilization's share, else --kv-cache-memory,
    else room for --max-num-seqs sequences of --max-model-len (capped at DEFAULT_KV_CACHE_BYTES)."""
    cache, sched = config.cache, config.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    layers = arch.num_hidden_layers + (config.speculative is not None)  # the MTP layer has its own cache
    bytes_per_block = cache.block_size * layers * arch.kv_cache_dim * dtype.itemsize
    if cache.gpu_memory_utilization is not None and cache.kv_cache_memory is None:
        return blocks_for_utilization(cache.gpu_memory_utilization, weights, bytes_per_block, device,
                                      config.parallel.ranks_per_node)
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} holds no KV block "
                             f"({bytes_per_block} bytes each); raise it")
        return int(blocks)
    # Default: room for every sequence at full length, capped at DEFAULT_KV_CACHE_BYTES.
    per_seq = -(-sched.max_model_len // cache.block_size)
    cap = max(per_seq, DEFAULT_KV_CACHE_BYTES // bytes_per_block)
    return int(min(per_seq * sched.max_num_seqs, cap))


def check_kv_pool(num_blocks: int, block_size: int, arch: DeepseekArch, dtype: torch.dtype, mtp: bool) -> None:
    """The pool fits in memory before it is allocated; else a MemoryError naming the flags that size it."""
    layers = arch.num_hidden_layers + mtp
    check_fits(num_blocks * block_size * layers * arch.kv_cache_dim * dtype.itemsize, torch.device("cpu"),
               f"the KV cache ({num_blocks} blocks of {block_size} tokens, {layers} layers)",
               "lower --kv-cache-memory, --num-kv-blocks or --gpu-memory-utilization (or --max-num-seqs / "
               "--max-model-len, which size the default pool)")
