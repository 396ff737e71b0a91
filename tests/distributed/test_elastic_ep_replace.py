"""--elastic-ep-replace (issue 37 stage 2): after a rank is lost the front end starts a replacement rank process;
it joins the next epoch, the experts spread over the full EP group again, and the outputs stay those of an
unfailed run; the degraded count goes back to 0. Real rank processes over gloo, float32, the tiny V3
checkpoint."""
import os
import re
import signal
import time

import pytest

from moeserve import LLM
from moeserve.config import ConfigError
from moeserve.engine.elastic import TEST_HANG_ENV
from moeserve.protocol import EngineCoreRequest
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS, elastic_llm, generate, kill_mid_decode


# a rank that built its engine core in a re-formation: (epoch, rank, slots received from peers, from the host
# copy, checkpoint expert tensors read)
BUILT = re.compile(r"joined epoch (\d+) as rank (\d+) of \d+ .* built its engine core[^(]*\((\d+) expert slots "
                   r"received from peers, (\d+) from the host copy, (\d+) checkpoint expert tensors read\)")


def wait_for_full_group(engine, size: int) -> None:
    """Let the idle front end read the replacement's hello and re-form with it (the server's stats heartbeat
    does this under `moeserve serve`)."""
    deadline = time.monotonic() + 180
    while (engine.dp_size < size or engine.recovery is not None or engine.joining) and time.monotonic() < deadline:
        engine.step(poll_s=0.1)
    assert engine.dp_size == size and engine.recovery is None and not engine.joining


def test_replacement_joins_and_serves_with_the_full_group(path, reference):
    llm = elastic_llm(path, 3, elastic_ep_replace=True)
    try:
        engine = llm.engine
        assert list(engine.ranks.spares) == [3]  # started ahead: imports done before any loss
        # the spare joins the survivors' re-formation: one epoch, one interruption
        assert kill_mid_decode(engine, 1) == reference
        wait_for_full_group(engine, 3)
        assert (engine.slots, engine.epoch) == ([0, 2, 3], 1)
        stats = engine.stats()
        assert (stats.elastic_ranks_lost, stats.elastic_ranks_replaced) == (1, 1)
        assert generate(llm) == reference
        assert all(s.num_steps > 0 for s in engine.rank_stats) and len(engine.rank_stats) == 3  # all three serve
        # the replacement is a rank like any other: its loss is replaced in turn, mid-decode, by the next
        # spare (started once rank 3 served; it may still be importing: the others wait for it)
        assert list(engine.ranks.spares) == [4]
        assert kill_mid_decode(engine, 3) == reference
        wait_for_full_group(engine, 3)
        assert (engine.slots, engine.epoch) == ([0, 2, 4], 2)
        stats = engine.stats()
        assert (stats.elastic_ranks_lost, stats.elastic_ranks_replaced) == (2, 2)
        assert generate(llm) == reference
        assert list(engine.ranks.spares) == [5]
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in [*engine.ranks.procs.values(), *engine.ranks.spares.values()])


def test_replacement_with_mtp_builds_for_the_survivors_map(mtp_ckpt_dir, capfd):
    # MTP, ranks 0 and 2 killed at once: the survivor keeps its core (the MTP layer's MoE block included) and
    # its 3 slots of each MoE layer; the spare builds its engine core for the survivor's map, not the default
    # one (a layer it laid out otherwise would route tokens to the wrong experts), the MTP layer's too; both
    # decode the unfailed engine's tokens with drafts, and so do the three after rank 4 joins, whose experts
    # (the MTP layer's included) all arrive from the two: it reads none
    model = mtp_ckpt_dir("v3")
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    want = generate(LLM(model, dtype="float32", speculative_config=mtp))
    llm = elastic_llm(model, 3, speculative_config=mtp, elastic_ep_replace=True)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, (0, 2)) == want
        assert engine.slots == [1, 3] and engine.stats().elastic_requeued < len(PROMPTS)  # rank 1 kept its own
        wait_for_full_group(engine, 3)
        assert engine.slots == [1, 3, 4]
        assert generate(llm) == want
        assert engine.stats().spec_num_drafts > 0
        degraded = engine.epoch - 1
    finally:
        llm.shutdown()
    built = [tuple(map(int, m.groups())) for m in BUILT.finditer(capfd.readouterr().err)]
    assert [(got > 0, hosted, read) for epoch, _, got, hosted, read in built if epoch > degraded] == [(True, 0, 0)]


def test_two_ranks_lost_at_once_are_both_replaced(path, reference, capfd):
    # the spare (rank 3) joins the survivor's re-formation; a fresh rank 4 starts once they serve and joins
    # the epoch after, when the two hold every expert: it receives its experts from them and reads none
    llm = elastic_llm(path, 3, elastic_ep_replace=True)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, (0, 2)) == reference
        assert engine.slots == [1, 3]  # the survivor and the spare finished them
        degraded = engine.epoch  # 1 or 2: the two deaths may be seen at once or one after the other
        wait_for_full_group(engine, 3)
        assert (engine.slots, engine.epoch) == ([1, 3, 4], degraded + 1)
        stats = engine.stats()
        assert (stats.elastic_ranks_lost, stats.elastic_ranks_replaced) == (2, 2)
        assert generate(llm) == reference
    finally:
        llm.shutdown()
    built = [tuple(map(int, m.groups())) for m in BUILT.finditer(capfd.readouterr().err)]
    assert [(got > 0, hosted, read) for epoch, _, got, hosted, read in built if epoch > degraded] == [(True, 0, 0)]
    assert any(read > 0 for epoch, *_, read in built if epoch <= degraded), built  # the spare: experts nobody held


def test_shutdown_while_the_replacement_starts(path):
    # rank 0 dies while idle; a request finds it and the re-formation begins with the spare (rank 3) sent on:
    # shutting down at once, before it could say it is up, leaves no process behind
    llm = elastic_llm(path, 3, elastic_ep_replace=True)
    engine = llm.engine
    try:
        os.kill(engine.ranks.procs[0].pid, signal.SIGKILL)
        engine.ranks.procs[0].wait(30)
        engine.add_request(EngineCoreRequest("r", PROMPTS[0], GREEDY, [1]))
        assert engine.slots == [1, 2, 3] and engine._awaiting == {3} and engine.recovery is not None
    finally:
        llm.shutdown()
    procs = {**engine.ranks.procs, **engine.ranks.spares}
    assert all(p.poll() is not None for p in procs.values()), {r: p.poll() for r, p in procs.items()}
    assert procs[3].returncode == -signal.SIGKILL  # killed while starting: it held nothing


def test_replace_needs_elastic_ep(path):
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, elastic_ep_replace=True)
    assert "--elastic-ep-replace" in str(e.value) and "--enable-elastic-ep" in str(e.value)


def test_spare_that_never_says_it_is_up_is_dropped(path, reference, monkeypatch):
    # rank 1 is killed mid-decode; the spare (rank 3) sent on spins before its hello, so the survivors wait
    # for it at the epoch's store; past --elastic-ep-timeout the front end kills it and the two re-form alone
    monkeypatch.setenv(TEST_HANG_ENV, "3:0:spin-before-hello")
    llm = elastic_llm(path, 3, elastic_ep_replace=True, elastic_ep_timeout=8)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, 1) == reference
        assert engine.hung_killed == [3] and engine.ranks.procs[3].poll() == -signal.SIGKILL
        assert (engine.slots, engine.epoch) == ([0, 2], 2)
        stats = engine.stats()
        assert stats.elastic_ranks_lost - stats.elastic_ranks_replaced == 1  # degraded: not replaced in turn
    finally:
        llm.shutdown()
