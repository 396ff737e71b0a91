"""A stopped rank (kill -STOP) is declared dead after --engine-stall-timeout (default 5 s), named, instead of
waiting for the gloo timeout (--distributed-timeout, 60 s here); a slow but running rank is not (issue 31)."""
import os
import signal
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.dp_client import EngineDeadError
from moeserve.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11]]


def test_stopped_rank_is_declared_dead_after_the_stall_timeout_and_named(ckpt_dir):
    llm = LLM(ckpt_dir("v3"), dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60)
    victim = None
    try:
        engine = llm.engine
        assert engine.stall_timeout == 5.0
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineCoreRequest(f"s{i}", p, SamplingParams(temperature=0, max_tokens=400,
                                                                            ignore_eos=True), [1]))
        while not engine.step():
            pass
        victim = engine.ranks.procs[1]
        os.kill(victim.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(dp 1, tp 0\) is stopped .*--engine-stall-timeout 5"):
            while engine.has_unfinished():
                engine.step()
        assert 5 <= time.monotonic() - start < 20  # the stall timeout decided, not the 60 s gloo timeout
        engine.ranks.join(timeout=15)
        assert len(engine.ranks.dead()) == 2  # the stopped rank was killed too, nothing left behind
    finally:
        if victim is not None and victim.poll() is None:
            os.kill(victim.pid, signal.SIGCONT)
        llm.shutdown()
