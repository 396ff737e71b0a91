"""Nothing one request carries may end the engine: bad values are refused when the params are built, and a
request whose logits break anyway (the model's own NaN, values that slipped past validation) fails alone
while the other requests of its batch go on and later requests are served as before."""
from __future__ import annotations

import math

import pytest

from moeserve import LLM, SamplingParams
from moeserve.protocol import EngineCoreRequest
from moeserve.sampling_params import SamplingParamsError
from tests.checkpoints import NAN_TOKEN, write_nan_token_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GOOD = [[5, 17, 99], [20, 21, 22, 23], list(range(30, 70))]
# NaN at position 2 of a 40-token prompt: every later position's KV is NaN too, in blocks reused afterwards.
POISONED = [5, 6, NAN_TOKEN] + list(range(100, 137))


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    """Greedy tokens of GOOD on the plain checkpoint (the NaN one differs only in token NAN_TOKEN's row)."""
    llm = LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=GOOD, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory):
    return write_nan_token_checkpoint(str(tmp_path_factory.mktemp("nan") / "v3-nan"))


@pytest.fixture(scope="module")
def llm(nan_path):
    return LLM(nan_path, max_model_len=256, dtype="float32", block_size=16)


def run(engine, requests):
    """Step an engine core until done: request id -> (tokens, error kind, error)."""
    for rid, ids, params in requests:
        engine.add_request(EngineCoreRequest(rid, ids, params, [1]))
    got = {rid: ([], None, None) for rid, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            toks, kind, err = got[out.request_id]
            got[out.request_id] = (toks + list(out.new_token_ids), out.error_kind or kind, out.error or err)
    return got


def slipped(**fields) -> SamplingParams:
    """Params with values set after validation (what a validation gap would let through)."""
    p = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def test_issue_request_is_refused_naming_the_field():
    with pytest.raises(SamplingParamsError, match="repetition_penalty must be in") as e:
        SamplingParams(max_tokens=1, temperature=1, repetition_penalty=1e-300)
    assert e.value.param == "repetition_penalty"


@pytest.mark.parametrize("field,values", [
    ("temperature", [-1, math.nan, math.inf]),
    ("top_p", [0, 1.5, math.nan]),
    ("top_k", [-2]),
    ("min_p", [-0.1, 1.1, math.nan]),
    ("presence_penalty", [2.5, -math.inf, math.nan]),
    ("frequency_penalty", [-2.5, math.inf]),
    ("repetition_penalty", [0, 1e-300, 0.001, 1e3, math.inf, math.nan, -1]),
    ("logprobs", [-1, 21]),
    ("max_tokens", [0, 2**64]),
    ("n", [0]),
])
def test_values_that_break_the_math_are_refused(field, values):
    for v in values:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**{field: v})
        assert e.value.param == field, (field, v)
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias={3: math.nan})
    assert e.value.param == "logit_bias"


def test_non_finite_logits_fail_that_request_alone(llm, reference):
    got = run(llm.engine, [
        ("good0", GOOD[0], GREEDY), ("nan", POISONED, GREEDY), ("good1", GOOD[1], GREEDY),
        ("rp", GOOD[0], slipped(repetition_penalty=1e-300)),  # 1e-300 is 0 in float32: logits / 0 = inf
        ("bias", GOOD[1], slipped(logit_bias={5: math.inf})), ("good2", GOOD[2], GREEDY)])
    assert [got[f"good{i}"] for i in range(3)] == [(r, None, None) for r in reference]
    toks, kind, err = got["nan"]
    assert toks == [] and kind == "internal" and "not finite" in err
    for rid, name in (("rp", "repetition_penalty=1e-300"), ("bias", "logit_bias of 1 tokens")):
        toks, kind, err = got[rid]
        assert toks == [] and kind == "invalid" and name in err, got[rid]
    assert not llm.engine.scheduler.requests and llm.engine.kv.usage == 0  # nothing left behind
    # The NaN request's blocks are reused by later requests: their outputs are unchanged.
    assert run(llm.engine, [(f"after{i}", p, GREEDY) for i, p in enumerate(GOOD)]) == \
        {f"after{i}": (r, None, None) for i, r in enumerate(reference)}


def test_llm_generate_raises_the_request_error_and_serves_afterwards(llm, reference):
    with pytest.raises(ValueError, match="not finite"):
        llm.generate(prompt_token_ids=[GOOD[0], POISONED], sampling_params=GREEDY)
    with pytest.raises(SamplingParamsError, match="repetition_penalty must be in"):  # checked again per sample
        llm.generate(prompt_token_ids=[GOOD[0]], sampling_params=slipped(repetition_penalty=1e-300))
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=GOOD, sampling_params=GREEDY)] == reference


def test_a_temperature_that_overflows_the_logits_fails_alone(llm, reference):
    # Finite logits, but divided by a temperature far below any sane value they overflow: NaN probabilities.
    hot = slipped(temperature=1e-5 + 1e-30, logit_bias={9: 100.0}, repetition_penalty=1e-36)
    got = run(llm.engine, [("hot", GOOD[0], hot), ("good", GOOD[1], GREEDY)])
    assert got["good"] == (reference[1], None, None)
    assert got["hot"][0] == [] and got["hot"][1] == "invalid" and "probabilities are not finite" in got["hot"][2]


def test_dp2_engine_fails_the_nan_request_alone(nan_path, reference):
    dp = LLM(nan_path, max_model_len=256, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
             distributed_timeout=30)
    try:
        got = run(dp.engine, [("g0", GOOD[0], GREEDY), ("nan", POISONED, GREEDY), ("g1", GOOD[1], GREEDY),
                              ("nan2", [NAN_TOKEN, 3], GREEDY), ("g2", GOOD[2], GREEDY)])
        assert [got[f"g{i}"] for i in range(3)] == [(r, None, None) for r in reference]
        assert got["nan"][1] == got["nan2"][1] == "internal"
        assert [o.outputs[0].token_ids for o in dp.generate(prompt_token_ids=GOOD, sampling_params=GREEDY)] \
            == reference
    finally:
        dp.shutdown()


@pytest.mark.parametrize("decode", ["standard", "amla"])
def test_stale_nan_in_free_kv_slots_changes_no_output(ckpt_dir, reference, decode):
    """Blocks are reused without clearing: slots past a sequence's length may hold an earlier request's NaN.
    Attention must ignore them exactly (a zero probability times NaN is still NaN), on every decode path."""
    llm = LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32", block_size=16, mla_decode=decode)
    for cache in llm.engine.runner.kv_caches:
        cache.fill_(math.nan)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=GOOD, sampling_params=GREEDY)] == reference


def test_out_of_vocabulary_stop_token_ids_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids entry 512 is outside the vocabulary"):
        llm.generate(prompt_token_ids=[GOOD[0]], sampling_params=SamplingParams(max_tokens=2, stop_token_ids=[3, 512]))


def test_a_request_the_engine_process_cannot_decode_is_answered(llm, tmp_path):
    """Params that fail validation only where the engine decodes them (an API server of another version)
    get an error output back instead of silence, and the next request is served."""
    import msgspec
    import zmq

    from moeserve.engine.engine_core_proc import EngineCoreProc
    from moeserve.protocol import MSG_ADD, MSG_OUTPUTS, EngineCoreOutputs

    address = f"ipc://{tmp_path}/core"
    proc = EngineCoreProc(llm.engine, address)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.connect(address)
    try:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        client.send_multipart([MSG_ADD, msgspec.msgpack.encode(
            EngineCoreRequest("bad", GOOD[0], slipped(repetition_penalty=1e-300), [1]))])
        client.send_multipart([MSG_ADD, msgspec.msgpack.encode(EngineCoreRequest("good", GOOD[0], GREEDY, [1]))])
        outs: dict[str, list] = {}
        while "good" not in outs or outs["good"][-1].finish_reason is None:
            proc.sock.poll(1000)
            proc._drain()
            if llm.engine.has_unfinished():
                proc._send_outputs(llm.engine.step())
            while client.poll(0):
                kind, payload = client.recv_multipart()
                assert kind == MSG_OUTPUTS
                for out in decoder.decode(payload).outputs:
                    outs.setdefault(out.request_id, []).append(out)
        assert "repetition_penalty" in outs["bad"][0].error and outs["bad"][0].error_kind == "invalid"
        assert sum((list(o.new_token_ids) for o in outs["good"]), []) == \
            llm.generate(prompt_token_ids=[GOOD[0]], sampling_params=GREEDY)[0].outputs[0].token_ids
    finally:
        client.close(0)
        proc.sock.close(0)


def test_allowed_token_ids_constrain_and_are_checked(llm):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=[10, 11, 12])
    out = llm.generate(prompt_token_ids=GOOD[:2], sampling_params=params)
    assert all(set(o.outputs[0].token_ids) <= {10, 11, 12} and len(o.outputs[0].token_ids) == 12 for o in out)
    with pytest.raises(ValueError, match="allowed_token_ids entry 512 is outside the vocabulary"):
        llm.generate(prompt_token_ids=[GOOD[0]], sampling_params=SamplingParams(allowed_token_ids=[3, 512]))
    with pytest.raises(SamplingParamsError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
