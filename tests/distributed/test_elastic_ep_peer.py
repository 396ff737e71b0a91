"""--enable-elastic-ep (issue 37): a survivor fills a new expert slot from a peer that holds the expert
(engine/elastic_transfer.py), reading the checkpoint only for experts no survivor holds. Real rank processes
over gloo, float32, the tiny V3 checkpoint (8 routed experts); each survivor's join line (stderr) says how it
filled its slots."""
import re

from moeserve import LLM
from moeserve.engine.elastic import TEST_HANG_ENV
from moeserve.engine.elastic_transfer import DISK, LOCAL, peer_routes
# GREEDY, PROMPTS: what the reference fixture (conftest.py) decodes for this module
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS, kill_mid_decode  # noqa: F401

# (epoch, rank, slots kept, received from peers, from the host copy, checkpoint tensors read)
JOINED = re.compile(r"joined epoch (\d+) as rank (\d+) of \d+ .*? kept its engine core \((\d+) expert slots kept, "
                    r"(\d+) received from peers, (\d+) from the host copy, (\d+) checkpoint tensors read\)")


def test_peer_routes_prefer_local_then_the_least_busy_holder_then_the_checkpoint():
    held = [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7]]  # expert 8 is held by nobody
    wants = [[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 2, 8], [4, 5, 6, 7, 0, 1]]
    assert peer_routes(held, wants) == [[LOCAL, LOCAL, LOCAL, LOCAL, 1, 2],
                                        [2, 2, 0, 0, LOCAL, DISK],
                                        [LOCAL, LOCAL, LOCAL, LOCAL, 0, 0]]
    # two holders of expert 2: the one that sends less so far
    assert peer_routes([[2], [2], [9]], [[2], [2], [2, 2]]) == [[LOCAL], [LOCAL], [0, 1]]


def test_survivors_on_the_default_layout_fill_slots_from_peers_not_the_checkpoint(path, reference, monkeypatch,
                                                                                   capfd):
    # D=4, 8 experts + 8 replicas: rank r holds 2r, 2r+1 and the next rank's two, so rank 3's experts (6, 7
    # and the replicas 0, 1) are all held by a survivor. Rank 0 votes other maps (the testing hook, as a keeper
    # left under other maps by a loss mid-re-formation): the survivors take the default layout of 3 ranks, 6
    # slots each, where every rank needs experts it does not hold; its peers send them, nothing is read
    monkeypatch.setenv(TEST_HANG_ENV, "0:0:other-maps")
    llm = LLM(path, dtype="float32", data_parallel_size=4, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=8, distributed_timeout=60)
    try:
        assert kill_mid_decode(llm.engine, 3) == reference
        assert llm.engine.stats().elastic_ranks_lost == 1
    finally:
        llm.shutdown()
    joins = [tuple(map(int, m.groups())) for m in JOINED.finditer(capfd.readouterr().err)]
    assert sorted(j[1] for j in joins) == [0, 1, 2] and {j[0] for j in joins} == {1}
    assert all(read == 0 for *_, read in joins), joins
    # survivors hold 4 of their 6 experts' slots at most; every layer's other slots arrive from a peer
    assert all(got > 0 for _, _, _, got, _, _ in joins), joins
