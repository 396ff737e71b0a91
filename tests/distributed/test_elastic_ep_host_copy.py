"""--elastic-ep-host-copy (issue 37): each rank keeps its routed experts in a host shared-memory file that
outlives it, so the survivors of a loss take the lost rank's experts (no survivor holds them) from there, not
from the checkpoint (engine/elastic_host_copy.py). Real rank processes over gloo, float32, the tiny V3
checkpoint; each survivor's join line (stderr) says how it filled its slots."""
import os

import pytest

from moeserve import LLM
from moeserve.config import ConfigError
from moeserve.engine import elastic_host_copy
# GREEDY, PROMPTS: what the reference fixture (conftest.py) decodes for this module
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS, generate, kill_mid_decode  # noqa: F401
from tests.distributed.test_elastic_ep_peer import JOINED


@pytest.mark.parametrize("quant", [None, "a8w8"])
def test_survivors_take_the_lost_experts_from_the_host_copy(path, capfd, quant):
    # D=3, 8 experts + 1 replica: rank 1's experts 3, 4, 5 have no replica; the survivors take them from rank
    # 1's file (A8W8: its int8 rows and scales, nothing quantized again) and read no checkpoint tensor
    kw = dict(quantization=quant) if quant else {}
    want = generate(LLM(path, dtype="float32", **kw))
    llm = LLM(path, dtype="float32", data_parallel_size=3, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=1, distributed_timeout=60, elastic_ep_host_copy=True, **kw)
    where = llm.engine.host_copy
    try:
        assert os.path.dirname(where) in ("/dev/shm", os.path.dirname(elastic_host_copy.folder(0)))
        assert len(os.listdir(where)) == 3  # one file per rank, written before it reported ready
        lost: list[str] = []
        assert kill_mid_decode(llm.engine, 1, lost) == want
        assert 0 < llm.engine.stats().elastic_requeued == len(lost) < len(PROMPTS)
    finally:
        llm.shutdown()
    assert not os.path.exists(where)  # the front end removed it
    joins = [tuple(map(int, m.groups())) for m in JOINED.finditer(capfd.readouterr().err)]
    assert sorted(j[1] for j in joins) == [0, 1], joins
    assert all(read == 0 for *_, read in joins) and sum(j[4] for j in joins) > 0, joins


def test_host_copy_needs_elastic_ep(path):
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, elastic_ep_host_copy=True)
    assert "--elastic-ep-host-copy" in str(e.value) and "--enable-elastic-ep" in str(e.value)



def test_a_second_loss_takes_what_the_lost_rank_took_over_from_the_first_ones_file(path, reference, capfd):
    # D=3: rank 2 dies, then rank 1, which holds some of rank 2's experts by then; files are never rewritten,
    # so the lone survivor finds those in rank 2's file and the rest of rank 1's in rank 1's: nothing is read
    llm = LLM(path, dtype="float32", data_parallel_size=3, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=1, distributed_timeout=60, elastic_ep_host_copy=True)
    try:
        assert kill_mid_decode(llm.engine, 2) == reference
        assert kill_mid_decode(llm.engine, 1) == reference  # request ids reused: the first batch has finished
        assert (llm.engine.slots, llm.engine.epoch) == ([0], 2)
    finally:
        llm.shutdown()
    joins = [tuple(map(int, m.groups())) for m in JOINED.finditer(capfd.readouterr().err)]
    assert sorted((j[0], j[1]) for j in joins) == [(1, 0), (1, 1), (2, 0)], joins
    assert all(read == 0 for *_, read in joins) and [j[4] > 0 for j in joins if j[0] == 2] == [True], joins


def test_host_copy_round_trip_and_a_write_that_fails_names_the_flag():
    # the file a rank writes holds each distinct expert once (its first slot), and fill() puts its rows into the
    # slots asked; a copy that cannot be written (here a file where the folder goes) fails naming the flag
    import types

    import torch

    from moeserve.engine.elastic_placement import slot_params
    from moeserve.layers.moe.experts import FusedExperts

    ex = FusedExperts(3, 8, 4, slot_experts=[5, 2, 5])
    for prm in ex.parameters(recurse=False):
        prm.data.copy_(torch.randn_like(prm))
    worker = types.SimpleNamespace(front_end_port=2)  # a port the front end never binds: a folder of its own
    where = elastic_host_copy.folder(2)
    try:
        assert elastic_host_copy.write(worker, [ex], slot_params) == 2 * (8 * 8 + 8 * 4) * 4
        fresh = [(n, torch.zeros_like(p)) for n, p in slot_params(ex)]
        host = elastic_host_copy.HostCopy(2)
        assert host.fill(0, "", 5, fresh, [1, 2]) and not host.fill(0, "", 7, fresh, [0])
        assert all(torch.equal(t[1], p[0]) and torch.equal(t[2], p[0]) and not t[0].any()
                   for (_, t), (_, p) in zip(fresh, slot_params(ex)))
    finally:
        import shutil

        shutil.rmtree(where, ignore_errors=True)
    open(where, "w").close()
    try:
        with pytest.raises(RuntimeError) as e:
            elastic_host_copy.write(worker, [ex], slot_params)
        assert "--elastic-ep-host-copy" in str(e.value) and "free in" in str(e.value)
    finally:
        os.unlink(where)
