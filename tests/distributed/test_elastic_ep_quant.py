"""--enable-elastic-ep (issue 37) with quantized routed experts: a survivor keeps its engine core and
re-places its A8W8 (int8 + per-channel scales) or FP8 (e4m3 + block scales) expert slots, copying what it
holds, receiving what a peer holds, quantizing only the experts it reads from the checkpoint as start-up
does; its requests go on where they ran. Real rank processes over gloo, float32, the tiny V3 checkpoint."""
import pytest

from moeserve import LLM
from moeserve.engine.elastic import TEST_HANG_ENV
from tests.distributed.test_elastic_ep import PROMPTS, generate, kill_mid_decode
from tests.distributed.test_elastic_ep_peer import JOINED


def _joins(capfd) -> list[tuple[int, ...]]:
    return [tuple(map(int, m.groups())) for m in JOINED.finditer(capfd.readouterr().err)]


@pytest.mark.parametrize("quant", ["a8w8", "fp8"])
def test_quantized_survivors_keep_their_cores_and_requests(path, fp8_path, capfd, quant):
    # D=3 loses rank 1 mid-decode: both survivors keep their cores (a rebuilt core would hold no request: all
    # 4 re-queued) and read only the lost rank's experts; the tokens are the unfailed quantized engine's
    model, kw = (path, dict(quantization="a8w8")) if quant == "a8w8" else (fp8_path, {})
    want = generate(LLM(model, dtype="float32", **kw))
    llm = LLM(model, dtype="float32", data_parallel_size=3, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=1, distributed_timeout=60, **kw)
    try:
        assert llm.config.quant.method == quant
        lost: list[str] = []
        assert kill_mid_decode(llm.engine, 1, lost) == want
        assert 0 < llm.engine.stats().elastic_requeued == len(lost) < len(PROMPTS)
        assert generate(llm) == want  # and the survivors serve on
    finally:
        llm.shutdown()
    joins = _joins(capfd)
    assert sorted(j[1] for j in joins) == [0, 1] and all(read > 0 for *_, read in joins), joins


@pytest.mark.parametrize("quant", ["a8w8", "fp8"])
def test_quantized_survivors_fill_slots_from_peers(path, fp8_path, monkeypatch, capfd, quant):
    # as test_elastic_ep_peer's default-layout case, quantized: the weights and their scales arrive from peers
    # (FP8 as bytes), nothing is read or quantized again
    model, kw = (path, dict(quantization="a8w8")) if quant == "a8w8" else (fp8_path, {})
    want = generate(LLM(model, dtype="float32", **kw))
    monkeypatch.setenv(TEST_HANG_ENV, "0:0:other-maps")
    llm = LLM(model, dtype="float32", data_parallel_size=4, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=8, distributed_timeout=60, **kw)
    try:
        assert kill_mid_decode(llm.engine, 3) == want
        assert llm.engine.stats().elastic_requeued < len(PROMPTS)
    finally:
        llm.shutdown()
    joins = _joins(capfd)
    assert len(joins) == 3 and all(read == 0 and got > 0 for _, _, _, got, _, read in joins), joins
