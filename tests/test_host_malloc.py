"""host_malloc: freed host memory stays in the process, so a repeated large temporary does not page-fault.

Each case runs in a fresh interpreter: the thresholds are process-wide and cannot be put back."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

FAULTS = r"""
import resource, sys, torch
from moeserve import host_malloc
torch.set_num_threads(1)  # the buffers in the main thread's heap
print("raised", host_malloc.keep_freed_memory())
def faults_of_one_buffer():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above glibc's largest dynamic mmap threshold
    t.fill_(1)  # touch every page
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print("faults", ",".join(str(faults_of_one_buffer()) for _ in range(ROUNDS)))
""".replace("ROUNDS", "30")

PAGES = (64 << 20) // 4096


def _buffers_faulted_in(out: dict[str, str]) -> int:
    """How many of the 30 buffers page-faulted their memory in (most of their 16384 pages)."""
    return sum(int(n) > PAGES // 2 for n in out["faults"].split(","))


def _run(code: str, **env) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def test_raised_thresholds_reuse_freed_memory():
    on = _run(FAULTS)
    assert on["raised"] == "True"
    # The heap grows a few times first: what the interpreter allocates between two buffers can sit in the
    # freed chunk (seen: 1 to 7 growths, varying run to run). Then every buffer reuses freed memory.
    assert _buffers_faulted_in(on) <= 10


def test_switched_off_each_buffer_faults_again():
    off = _run(FAULTS, MOESERVE_MALLOC_TUNING="0")
    assert off["raised"] == "False"
    assert _buffers_faulted_in(off) == 30  # the control: glibc's defaults map and fault every buffer anew


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1048576"}, {"LD_PRELOAD": "/nowhere/libjemalloc.so.2"}])
def test_left_alone_where_the_process_chose_its_allocator(env):
    assert _run(FAULTS, **env)["raised"] == "False"


def test_engine_core_raises_them():
    code = ("from moeserve import LLM, host_malloc\n"
            "print('before', host_malloc._done)\n"
            "LLM(enforce_eager=True, max_model_len=256)\n"
            "print('after', host_malloc._done)\n")
    res = _run(code)
    assert res["before"] == "None" and res["after"] == "True"
