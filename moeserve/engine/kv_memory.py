"""Memory before allocation of the KV pool: `--gpu-memory-utilization` (vLLM's) sizes it as the share of the
device's memory left after the weights (on CPU the device is host RAM); moeserve/device_memory.py has the
device figures and the check that names the flag to change.
"""
from __future__ import annotations

import torch

from moeserve.device_memory import GiB, total_memory

ACTIVATION_RESERVE = 0.05  # of the utilization budget, kept for activations and the sampler


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
