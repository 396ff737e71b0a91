"""Requests survive an engine restart (issue 31): a request re-submitted with the tokens it generated so far
(EngineCoreRequest.output_token_ids) continues exactly where it stopped, on a fresh engine core."""
import pytest

from moeserve.engine.engine_core import EngineCore
from moeserve.engine_args import EngineArgs
from moeserve.protocol import EngineCoreRequest
from moeserve.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 7, 99, 3]


def _generate(core: EngineCore, req: EngineCoreRequest) -> list[int]:
    core.add_request(req)
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=1234),  # the seed's generator is put where the first engine's was
    dict(temperature=0.8, seed=7, top_k=20, frequency_penalty=0.5, presence_penalty=0.3),
], ids=["greedy", "seeded", "seeded-penalties"])
def test_a_resumed_request_continues_exactly(ckpt_dir, params):
    args = EngineArgs(model=ckpt_dir("v3"), dtype="float32")
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **params)
    whole = _generate(EngineCore(args.create_config(256)), EngineCoreRequest("a", PROMPT, sp))
    assert len(whole) == 24
    for cut in (1, 9):  # the restarted engine is a new EngineCore: no state of the first one survives
        rest = _generate(EngineCore(args.create_config(256)),
                         EngineCoreRequest("a", PROMPT, sp, output_token_ids=whole[:cut]))
        assert whole[:cut] + rest == whole, cut
