import os

import pytest
import torch

# Engines run their decode eagerly in the suite (inherited by every engine and server process it starts):
# compiling the decode graphs costs seconds per engine, and the compiled path has its own equality tests
# (tests/engine/test_compiled_decode.py), which lift this.
os.environ.setdefault("MOESERVE_ENFORCE_EAGER", "1")
# No standby engine core behind every server the suite starts (each would import torch and the engine, with DP
# its ranks too, while the test runs: measured +14% on two server test files); the restart tests that are
# about it ask for it with --engine-standby.
os.environ.setdefault("MOESERVE_ENGINE_STANDBY", "0")

# One thread: the models are tiny, and on a shared 2-core machine a second OpenMP thread stalls at every
# barrier while the other core is busy (measured: 30x slower small GEMMs).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Session-wide folder of tiny checkpoints, one per variant, written on first use."""
    from tests.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("ckpts")

    def get(variant: str = "v3", **overrides) -> str:
        name = variant + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
        return write_checkpoint(str(root / name), variant, **overrides)

    return get


@pytest.fixture(scope="session")
def openai_server(ckpt_dir):
    """One `moeserve serve` (2 API servers) on the tiny V3 checkpoint, shared by server and bench tests."""
    from tests.entrypoints.server import ServerProcess

    server = ServerProcess(ckpt_dir("v3"), "--api-server-count", "2", "--max-model-len", "256",
                           "--dtype", "float32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mtp_ckpt_dir(tmp_path_factory):
    """Tiny checkpoints with an MTP layer (model.layers.{L}.*), one per variant, written on first use."""
    from tests.checkpoints import write_mtp_checkpoint

    root = tmp_path_factory.mktemp("mtp_ckpts")

    def get(variant: str = "v3", **kw) -> str:
        name = variant + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        return write_mtp_checkpoint(str(root / name), variant, **kw)

    return get


@pytest.fixture
def without_fused_experts(monkeypatch):
    """BF16 routed experts on the per-expert paths, in this process and the rank processes it starts. A fused
    MoE kernel (zentorch, amx) sums a token's k experts inside one call, where expert parallelism's combine adds
    up k rows rounded on their ranks: BF16 greedy tokens of one rank and of several then differ in rounding, and
    on the tiny random models a later token can flip. Tests that compare the two layouts token for token, about
    something else than the kernels, ask for this (tests/distributed/test_zen_ep.py compares fused layouts)."""
    from moeserve.layers.moe import amx, zen
    monkeypatch.setenv("MOESERVE_AMX_MOE", "0")
    monkeypatch.setenv("MOESERVE_ZENTORCH", "0")
    monkeypatch.setattr(amx, "available", lambda: False)
    monkeypatch.setattr(zen, "available", lambda: False)
