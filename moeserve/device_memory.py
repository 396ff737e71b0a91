"""Device memory before allocation: what a device has, what a module's parameters need, checked first.

A raw allocator traceback names neither the need nor the flag that changes it; check_fits runs before the
allocation and says both. Below models/ (the weights are checked between meta construction and allocation)
and engine/ (engine/kv_memory.py sizes the KV pool with it).
"""
from __future__ import annotations

import os

import torch

GiB = 1 << 30


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
