"""--enable-elastic-ep with online EPLB (issue 37): a rank dies inside an EPLB weight move (the testing-only hook
MOESERVE_TEST_ELASTIC_HANG=RANK:STEP:die-in-move SIGKILLs it after the move's first layer posted its
transfers, the others' transfers to and from it still in flight); the survivors leave the move, re-form
without it and every request finishes with the greedy tokens of an unfailed run. Real rank processes over
gloo, float32, the tiny V3 checkpoint."""
import signal

import pytest

from moeserve.engine.elastic import TEST_HANG_ENV
# GREEDY, PROMPTS: what the reference fixture (conftest.py) decodes for this module
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS, elastic_llm, generate  # noqa: F401


@pytest.mark.parametrize("rank", [2, 0])
def test_rank_killed_inside_an_eplb_weight_move(path, reference, monkeypatch, rank):
    # EPLB rebalances every 2 steps; from its 3rd step on, the rank dies inside the first move it starts
    monkeypatch.setenv(TEST_HANG_ENV, f"{rank}:3:die-in-move")
    llm = elastic_llm(path, 3, enable_eplb=True, eplb_step_interval=2)
    try:
        engine = llm.engine
        assert generate(llm) == reference  # none lost, none changed
        assert engine.ranks.procs[rank].poll() == -signal.SIGKILL  # the hook fired: a move had started
        assert rank not in engine.slots and (engine.dp_size, engine.epoch) == (2, 1)
        stats = engine.stats()
        # the lost rank's requests are re-queued, the survivors keep theirs (every rank had one: 4 over 3)
        assert stats.elastic_ranks_lost == 1 and 0 < stats.elastic_requeued < len(PROMPTS)
        before = stats.eplb_rebalances
        assert generate(llm) == reference  # the two survivors serve on, rebalancing as they go
        assert engine.stats().eplb_rebalances > before
    finally:
        llm.shutdown()
