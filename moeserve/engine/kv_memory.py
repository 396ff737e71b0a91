"""Memory before allocation: how much the weights and the KV pool need, checked against what the device has.

A raw allocator traceback names neither the need nor the flag that changes it; these checks run before the
allocation and say both. `--gpu-memory-utilization` (vLLM's) sizes the KV pool as the share of the device's
memory left after the weights (on CPU the device is host RAM).
"""
from __future__ import annotations

import os

import torch

GiB = 1 << 30
ACTIVATION_RESERVE = 0.05  # of the utilization budget, kept for activations and the sampler


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory(device: torch.device) -> int:
    """Bytes an allocation can take now: CUDA's free memory, or the kernel's MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters (also on the meta device, before they exist)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def check_fits(need: int, device: torch.device, what: str, flags: str) -> None:
    """Raise MemoryError naming the need, what is free and the flags that change the need."""
    have = free_memory(device)
    if need > have:
        raise MemoryError(f"{what} needs {need / GiB:.2f} GiB but {device.type} memory has {have / GiB:.2f} GiB "
                          f"free; {flags}")


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
