"""Structured-output specs are compiled where the request is built (API server, LLM), never on the engine's
loop: the request carries its checked grammar as bytes, an engine process refuses to compile, and what it
loads is checked and bounded."""
from __future__ import annotations

import json

import msgspec
import pytest

from moeserve import LLM, SamplingParams
from moeserve.protocol import EngineCoreRequest
from moeserve.structured import guidance
from moeserve.structured import params as so_params
from moeserve.structured.errors import PatternError
from moeserve.structured.guidance import GuidanceGrammar
from moeserve.structured.params import StructuredOutputsParams as SO
from moeserve.structured.params import compile_params, structured_grammar

ENUM = [f"value-{i}" for i in range(1000)]
SCHEMA = {"type": "object", "properties": {"k": {"enum": ENUM}}, "required": ["k"]}


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32")


def run(engine, requests):
    for r in requests:
        engine.add_request(r)
    got = {r.request_id: ([], None) for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            toks, err = got[out.request_id]
            got[out.request_id] = (toks + list(out.new_token_ids), out.error or err)
    return got


def wire(req: EngineCoreRequest) -> bytes:
    return msgspec.msgpack.encode(req)


def test_the_engine_loads_the_sent_grammar_and_never_compiles(llm):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=SCHEMA))  # compiles here
    sent = wire(EngineCoreRequest("big", [5, 17, 99], params, [1], structured_grammar=structured_grammar(params)))
    other = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="[ab]{3}"))
    bare = wire(EngineCoreRequest("bare", [5, 17, 99], other, [1]))  # a builder that did not send it
    again = wire(EngineCoreRequest("again", [5, 18], params, [1]))  # the engine holds this spec already
    llm.engine.structured = None  # the engine's grammar cache: empty, as in a fresh engine process
    so_params.compile_in_this_process(False)
    so_params._cache.clear()
    try:
        decoder = msgspec.msgpack.Decoder(EngineCoreRequest)  # as engine_core_proc decodes
        got = run(llm.engine, [decoder.decode(sent), decoder.decode(bare), decoder.decode(again)])
        with pytest.raises(PatternError, match="not compiled in an engine process"):
            compile_params(SO(regex="a+"))
    finally:
        so_params.compile_in_this_process(True)
    for rid in ("big", "again"):
        toks, err = got[rid]
        assert err is None and json.loads(llm.get_tokenizer().decode(toks, skip_special_tokens=True))["k"] in ENUM
    assert got["bare"][0] == [] and "checked grammar" in got["bare"][1]
    assert not so_params._cache  # nothing was compiled while the engine ran


def test_round_trip_and_damaged_grammars_are_refused(llm):
    g = compile_params(SO(regex=r"[a-f]{2,4}-\d"))
    back = GuidanceGrammar.from_bytes(g.to_bytes())
    assert back.grammar == g.grammar and back.fullmatch(b"abc-1") and not back.fullmatch(b"abc-")
    data = g.to_bytes()
    for bad in (b"junk" + data, data[len(guidance.WIRE_MAGIC) - 1:], b"LLG1\n" + b"\xff" * 8,
                guidance.WIRE_MAGIC + b"x" * (16 * guidance.MAX_SPEC_BYTES + 1)):
        with pytest.raises(ValueError):
            GuidanceGrammar.from_bytes(bad)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex=r"[a-f]{2,4}-\d"))
    llm.engine.structured = None
    got = run(llm.engine, [EngineCoreRequest("damaged", [5, 6], params, [1], structured_grammar=data[:-3]),
                           EngineCoreRequest("fine", [5, 6], SamplingParams(temperature=0, max_tokens=4), [1])])
    assert got["damaged"][0] == [] and got["damaged"][1], got["damaged"]
    assert got["fine"][1] is None and len(got["fine"][0]) == 4


def test_a_grammar_over_the_parser_limits_is_a_pattern_error(monkeypatch):
    monkeypatch.setitem(guidance._LIMITS, "initial_lexer_fuel", 10)
    so_params._cache.clear()
    with pytest.raises(PatternError, match=r"the json is too large: initial lexer configuration \(grammar\) too big"):
        compile_params(SO(json=SCHEMA))
    so_params._cache.clear()
