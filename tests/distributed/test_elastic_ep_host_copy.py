"""--elastic-ep-host-copy (issue 37): each rank keeps its routed experts in a host shared-memory file that
outlives it, so the survivors of a loss take the lost rank's experts (no survivor holds them) from there, not
from the checkpoint (engine/elastic_host_copy.py). Real rank processes over gloo, float32, the tiny V3
checkpoint; each survivor's join line (stderr) says how it filled its slots."""
import os

import pytest

from moeserve import LLM
from moeserve.config import ConfigError
from moeserve.engine import elastic_host_copy
from tests.distributed.test_elastic_ep import PROMPTS, generate, kill_mid_decode
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
