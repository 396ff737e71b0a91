"""--elastic-ep-replace (issue 37): a replacement rank's routed experts come from where they already are. Its
build reads no checkpoint tensor of an expert a survivor holds (the survivor sends it, in the same collective
as the survivors' own re-placement) or the host copy has (--elastic-ep-host-copy); quantized experts arrive
with their scales (engine/elastic_replace.py). Real rank processes over gloo, the tiny V3 checkpoint; each
rank's join line (stderr) says how it filled its slots."""
import pytest

from moeserve import LLM
from tests.distributed.test_elastic_ep import generate, kill_mid_decode
from tests.distributed.test_elastic_ep_replace import BUILT, wait_for_full_group


def _replace_one(llm, capfd, lost: int, ranks: int, want, slots: list[int] | None = None) -> tuple[int, int, int]:
    """Kill rank `lost` mid-decode (the tokens are `want`), wait for the spare to bring the group back to
    `ranks` (in process slots `slots` when given), serve again (`want` again), shut down; the one join line's
    (slots received from peers, slots from the host copy, checkpoint expert tensors read). The spare is rank
    ranks - 1 of epoch 1."""
    try:
        assert kill_mid_decode(llm.engine, lost) == want
        wait_for_full_group(llm.engine, ranks)
        if slots is not None:
            assert llm.engine.slots == slots
        assert generate(llm) == want
    finally:
        llm.shutdown()
    built = [tuple(map(int, m.groups())) for m in BUILT.finditer(capfd.readouterr().err)]
    assert [(epoch, rank) for epoch, rank, *_ in built] == [(1, ranks - 1)], built
    return built[0][2:]


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "a8w8"),
                                         ("float32", "fp8")])
def test_replacement_receives_the_experts_the_survivors_hold(path, fp8_path, capfd, dtype, quant,
                                                            without_fused_experts):
    # D=4, 8 experts + 8 replicas: rank r holds 2r, 2r+1 and the next rank's two, so every expert of rank 3
    # has a replica on a survivor. Rank 3 is killed mid-decode; the spare joins that re-formation, builds its
    # core for the survivors' map (experts 0, 1, 6, 7: the fewest copies) and receives all of them from the
    # survivors (A8W8 / FP8: weights and scales as served): no checkpoint expert tensor is read. Its outputs
    # are those of the unfailed engine, during the loss and once the four serve again. Eager: the unfailed and
    # the degraded epochs decode alike (BF16 would round differently through the compiled graphs, and through
    # a fused MoE kernel: without_fused_experts)
    model, kw = (fp8_path, {}) if quant == "fp8" else (path, dict(quantization=quant) if quant else {})
    want = generate(LLM(model, dtype=dtype, enforce_eager=True, **kw))
    llm = LLM(model, dtype=dtype, data_parallel_size=4, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=8, distributed_timeout=60, elastic_ep_replace=True, enforce_eager=True, **kw)
    got, hosted, read = _replace_one(llm, capfd, lost=3, ranks=4, want=want, slots=[0, 1, 2, 4])
    assert llm.config.quant.method == quant
    assert (got > 0, hosted, read) == (True, 0, 0)


@pytest.mark.parametrize("quant", [None, "a8w8"])
def test_replacement_takes_the_lost_experts_from_the_host_copy(path, capfd, quant):
    # D=3, 8 experts + 1 replica: rank 1's experts 3, 4, 5 have no replica; the spare that replaces it takes
    # them from rank 1's host-copy file (A8W8: its int8 rows and scales) and reads no checkpoint expert tensor
    kw = dict(quantization=quant) if quant else {}
    want = generate(LLM(path, dtype="float32", **kw))
    llm = LLM(path, dtype="float32", data_parallel_size=3, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=1, distributed_timeout=60, elastic_ep_replace=True, elastic_ep_host_copy=True,
              **kw)
    got, hosted, read = _replace_one(llm, capfd, lost=1, ranks=3, want=want)
    assert (got, hosted > 0, read) == (0, True, 0)
