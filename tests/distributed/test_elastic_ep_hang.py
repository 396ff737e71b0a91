"""--enable-elastic-ep with a hung rank (issue 37): a rank process that is alive and not stopped, but begins no
collective while its peers wait on it for --elastic-ep-hang-timeout (it spins or blocks), is killed and the
others re-form without it; every request finishes with the greedy tokens of an unfailed run. A rank whose step
is long but makes progress (it begins collectives, slowly) is left alone. Real rank processes over gloo,
float32, the tiny V3 checkpoint; the hang is the testing-only hook MOESERVE_TEST_ELASTIC_HANG
(engine/elastic.py test_hang_hook)."""
import signal
import time

import pytest

from moeserve import LLM
from moeserve.config import ConfigError
from moeserve.engine.elastic import TEST_HANG_ENV, hung_ranks
# GREEDY, PROMPTS: what the reference fixture (conftest.py) decodes for this module
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS, elastic_llm, generate, kill_mid_decode  # noqa: F401

HANG_S = 3.0  # --elastic-ep-hang-timeout of these tests


@pytest.mark.parametrize("dp,rank,mode", [(3, 1, "spin"), (2, 0, "block")])
def test_hung_rank_is_killed_and_the_others_finish_every_request(path, reference, monkeypatch, dp, rank, mode):
    # the rank hangs before the forward of its 6th step (mid-decode): its peers wait in that step's first
    # collective, the front end sees its count lag theirs for HANG_S and kills it
    monkeypatch.setenv(TEST_HANG_ENV, f"{rank}:6:{mode}")
    llm = elastic_llm(path, dp, elastic_ep_hang_timeout=HANG_S)
    try:
        engine = llm.engine
        assert generate(llm) == reference  # none lost, none changed
        assert engine.hung_killed == [rank]
        assert engine.ranks.procs[rank].poll() == -signal.SIGKILL
        assert rank not in engine.slots and (engine.dp_size, engine.epoch) == (dp - 1, 1)
        stats = engine.stats()
        # the hung rank's requests are re-queued, the survivors keep theirs (every rank had one: 4 over 2 or 3)
        assert stats.elastic_ranks_lost == 1 and 0 < stats.elastic_requeued < len(PROMPTS)
        assert generate(llm) == reference  # the survivors serve on; their hang check runs in the new epoch
        assert engine.hung_killed == [rank]
    finally:
        llm.shutdown()


def test_a_long_step_that_makes_progress_is_not_cut_short(path, reference, monkeypatch):
    # rank 1's 4th step sleeps 1 s before each collective it begins: the step lasts many times HANG_S, but
    # the rank begins a collective every second, so nobody is killed
    monkeypatch.setenv(TEST_HANG_ENV, "1:4:crawl:1.0")
    llm = elastic_llm(path, 2, elastic_ep_hang_timeout=HANG_S)
    try:
        engine = llm.engine
        started = time.monotonic()
        assert generate(llm) == reference
        took = time.monotonic() - started
        assert took > 2 * HANG_S, f"the crawling step was not long ({took:.1f} s): the test proves nothing"
        assert engine.hung_killed == []
        assert (engine.dp_size, engine.epoch, engine.stats().elastic_ranks_lost) == (2, 0, 0)
    finally:
        llm.shutdown()


def test_hung_ranks_are_those_the_others_wait_for():
    assert hung_ranks({0: (1, 40), 1: (1, 39), 2: (1, 40)}, 1) == [1]
    assert hung_ranks({0: (1, 39), 1: (1, 39), 2: (1, 41)}, 1) == [0, 1]
    assert hung_ranks({0: (1, 40), 1: (1, 40)}, 1) == []  # level: a long stretch of compute, or all wait
    assert hung_ranks({0: (1, 40), 1: (0, 12)}, 1) == []  # a rank not counting in this epoch yet
    assert hung_ranks({}, 0) == []


def test_hang_timeout_must_be_below_the_collective_timeout(path):
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, enable_elastic_ep=True,
            distributed_timeout=30, elastic_ep_hang_timeout=30)
    assert "--elastic-ep-hang-timeout 30 must be below --distributed-timeout 30" in str(e.value)
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, enable_elastic_ep=True,
            elastic_ep_hang_timeout=0)
    assert "--elastic-ep-hang-timeout must be > 0" in str(e.value)


def test_survivor_hung_while_re_forming_is_killed_and_the_rest_re_form(path, reference, monkeypatch):
    # rank 2 is killed mid-decode; rank 1 spins once it has joined epoch 1's process groups, so rank 0 waits on
    # it there; past --elastic-ep-timeout the front end kills rank 1 (its count of epoch 1's collectives lags
    # rank 0's) instead of giving up, and rank 0 alone finishes every request in epoch 2
    monkeypatch.setenv(TEST_HANG_ENV, "1:0:spin-at-join")
    llm = elastic_llm(path, 3, elastic_ep_timeout=8)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, 2) == reference
        assert engine.hung_killed == [1] and engine.ranks.procs[1].poll() == -signal.SIGKILL
        assert (engine.slots, engine.epoch, engine.stats().elastic_ranks_lost) == ([0], 2, 2)
    finally:
        llm.shutdown()
