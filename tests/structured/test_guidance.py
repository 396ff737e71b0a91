"""llguidance, the grammar engine: a request's rows with drafts, end tokens and a thinking marker, the wire
form, refusals, and through the real engine (numeric bounds, Lark and GBNF grammars, structural_tag, MTP) and a
real server (openai's .parse() and LangChain of pydantic models with bounded fields). Masks against
independent oracles: test_token_masks.py."""
import json
import re

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

from moeserve import LLM, SamplingParams
from moeserve.sampling_params import SamplingParamsError
from moeserve.structured.grammar import StructuredOutputManager, token_bytes
from moeserve.structured.guidance import GuidanceGrammar, ascii_classes
from moeserve.structured.params import StructuredOutputsParams as SO, compile_params
from tests.checkpoints import tokenizer as tiny_tokenizer
from tests.structured.oracle import json_prefix, regex_prefix


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def manager(tok):
    return StructuredOutputManager("unused", len(tok) + 3, tokenizer=tok)  # a padded model vocabulary


def test_rows_follow_the_drafts_and_end_tokens_need_a_match(tok, manager):
    pieces = token_bytes(tok, len(tok))
    ids = {p: i for i, p in enumerate(pieces) if p in (b"a", b"b", b"c", b"x")}
    eos = tok.eos_token_id
    m = manager.matcher(SO(choice=["ab", "abc"]))
    rows = m.row_masks([ids[b"a"]], [ids[b"b"], ids[b"x"], ids[b"c"]], [eos])
    assert rows.shape == (4, len(tok) + 3)
    assert rows[0, ids[b"b"]] and not rows[0, eos]  # after "a": "b", not the end
    assert rows[1, ids[b"c"]] and rows[1, eos]  # after "ab": "c" or the end
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])  # draft "x" breaks: never used
    # drafts were rolled back: the same output gives the same first row again
    assert torch.equal(m.row_masks([ids[b"a"]], [], [eos])[0], rows[0])
    assert m.row_masks([ids[b"a"], ids[b"b"], ids[b"c"]], [], [eos])[0].nonzero().flatten().tolist() == [eos]
    # a shorter output (a preempted request recomputed) starts again from the output tokens
    assert m.row_masks([ids[b"a"]], [], [eos])[0, ids[b"b"]]
    # past the end (ignore_eos sampled EOS): only the fallback is left
    done = [ids[b"a"], ids[b"b"], ids[b"c"], eos]
    assert m.row_masks(done, [], [], [eos])[0].nonzero().flatten().tolist() == [eos]


def test_a_stop_token_with_text_is_allowed_only_where_its_text_completes_a_match(tok, manager):
    pieces = token_bytes(tok, len(tok))
    ids = {p: i for i, p in enumerate(pieces) if p in (b"a", b"b", b"c")}
    m = manager.matcher(SO(choice=["ab", "abc"]))
    rows = m.row_masks([ids[b"a"]], [], [ids[b"b"], ids[b"c"]])  # stop_token_ids with text
    assert rows[0, ids[b"b"]] and not rows[0, ids[b"c"]]  # "ab" matches, "ac" does not


def test_after_a_marker_the_pattern_applies(tok, manager):
    pieces = token_bytes(tok, len(tok))
    ids = {p: i for i, p in enumerate(pieces) if p in (b"a", b"<", b"/", b"x", b"y", b"e", b"s", b">")}
    m = manager.matcher(SO(choice=["yes", "no"], after="</x>"))
    eos = tok.eos_token_id
    thinking = [ids[b"a"], ids[b"<"], ids[b"/"]]
    assert m.row_masks(thinking, [], [eos]) is None  # free text
    rows = m.row_masks(thinking, [ids[b"x"], ids[b">"], ids[b"y"]], [eos])
    assert rows[0].all() and rows[1].all()  # "a</x" still thinking
    assert rows[2, ids[b"y"]] and not rows[2, ids[b"a"]] and not rows[2, eos]
    assert rows[3, ids[b"e"]] and not rows[3, ids[b"y"]]
    after = thinking + [ids[b"x"], ids[b">"], ids[b"y"], ids[b"e"], ids[b"s"]]
    assert m.row_masks(after, [], [eos])[0].nonzero().flatten().tolist() == [eos]


def test_the_wire_form_round_trips_and_junk_is_refused():
    g = compile_params(SO(grammar='start: "a" /[0-9]+/'))
    back = GuidanceGrammar.from_bytes(g.to_bytes())
    assert back.grammar == g.grammar and back.fullmatch(b"a12") and not back.fullmatch(b"b")
    with pytest.raises(ValueError):
        GuidanceGrammar.from_bytes(b"junk" + g.to_bytes())


def test_regex_classes_are_ascii_and_nesting_is_bounded():
    assert ascii_classes(r"[\d.]+\s\W") == r"[0-9.]+[ \t\n\r\f\v][^0-9A-Za-z_]"
    g = compile_params(SO(regex=r"\d{2}"))
    assert g.fullmatch(b"12") and not g.fullmatch("١٢".encode())  # Arabic-Indic digits are not \d here
    with pytest.raises(SamplingParamsError, match="nested more than 50"):
        SamplingParams(structured_outputs=SO(regex="(" * 51 + "a" + ")" * 51))


@pytest.mark.parametrize("kw,words", [
    # not enforceable: refused (never dropped), naming the keyword, where it is and what to write instead
    (dict(json={"type": "array", "uniqueItems": True}), "'uniqueItems' at #: remove it and check"),
    (dict(json={"properties": {"a": {"if": {"type": "integer"}, "then": {"minimum": 3}}}}),
     "'if' at #/properties/a: write the cases as alternatives: \"anyOf\""),
    (dict(json={"properties": {"not": {"type": "string", "not": {"const": "x"}}}}),
     "'not' at #/properties/not: list what is allowed instead"),
    (dict(json={"type": "array", "uniqueItems": True}), "x-guidance"),
    (dict(grammar="start: foo"), "foo"), (dict(grammar="root ::= 'a'"), "GBNF|Lark|name"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 3}), "minimum"),
    (dict(structural_tag={"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}]}),
     "triggers"),
])
def test_what_it_cannot_do_is_refused_naming_it(kw, words):
    with pytest.raises(SamplingParamsError, match=words):
        SamplingParams(structured_outputs=SO(**kw))


def test_no_op_and_lenient_keywords_compile():
    assert compile_params(SO(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": False}))
    lenient = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "x-guidance": {"lenient": True}}
    assert compile_params(SO(json=lenient)).fullmatch(b"[1,1]")  # asked for: generated without it


def test_the_removed_builtin_backend_is_a_clear_error():
    import os
    import subprocess
    import sys
    env = {**os.environ, "MOESERVE_STRUCTURED_BACKEND": "builtin"}
    r = subprocess.run([sys.executable, "-c", "import moeserve.structured.params"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode and "runs on llguidance only" in r.stderr and "unset the variable" in r.stderr, r.stderr


# --- through the real engine ---------------------------------------------------------------------------

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61))]
BOUNDED = {"type": "object", "properties": {
    "rating": {"type": "integer", "minimum": 1, "maximum": 9},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
    "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "maxItems": 2}},
    "required": ["rating", "score"], "$defs": {"Tag": {"enum": ["a", "b"]}}}
LARK = r'''
start: "(" expr ")"
expr: NUM | NUM OP expr
OP: "+" | "*"
NUM: /[1-9][0-9]{0,2}/
'''
GBNF = r'''root ::= "<" word ("," word){0,3} ">"
word ::= [a-d]+'''


@pytest.fixture(scope="module")
def llm(mtp_ckpt_dir):
    return LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False)


@pytest.mark.parametrize("spec,check", [
    (SO(json=BOUNDED), lambda t: jsonschema.validate(json.loads(t), BOUNDED) is None),
    (SO(grammar=LARK), lambda t: re.fullmatch(r"\([1-9]\d{0,2}([+*][1-9]\d{0,2})*\)", t)),
    (SO(grammar=GBNF), lambda t: re.fullmatch(r"<[a-d]+(,[a-d]+){0,3}>", t)),
], ids=["numeric-bounds", "lark", "gbnf"])
def test_sampled_outputs_match_through_the_engine(llm, spec, check):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3, n=6, max_tokens=120, structured_outputs=spec)
    for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params):
        for c in o.outputs:
            assert c.finish_reason == "stop" and check(c.text), c.text


def test_structural_tag_masks_only_inside_the_tag(tok, manager):
    tag = {"triggers": ["<f"], "structures": [{"begin": "<f>", "end": "</f>", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 5}}, "required": ["n"]}}]}
    pieces = token_bytes(tok, len(tok))
    one = {p: i for i, p in enumerate(pieces) if p and len(p) == 1}
    m = manager.matcher(SO(structural_tag=tag))
    free = [one[b] for b in (b"a", b" ", b"x")]
    assert m.row_masks(free, [], [tok.eos_token_id])[0].sum() > len(tok) // 2  # free text, may end
    inside = free + [one[b"<"], one[b"f"], one[b">"], one[b"{"], one[b'"'], one[b"n"], one[b'"'], one[b":"]]
    row = m.row_masks(inside, [], [tok.eos_token_id])[0]
    got = [pieces[t] for t in row.nonzero().flatten().tolist()]  # a digit 2-5, or one space first
    assert {p.removeprefix(b" ") for p in got} - {b""} == {b"2", b"3", b"4", b"5"} and b"  " not in got, got


def test_structural_tag_format_is_the_legacy_tag():
    """vLLM's newer {"format": triggered_tags of JSON schemas} is the same grammar as the legacy shape; what has
    no llguidance equivalent is refused naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    legacy = {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}
    fmt = {"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}]}}
    assert compile_params(SO(structural_tag=fmt)).grammar == compile_params(SO(structural_tag=legacy)).grammar
    for bad, words in (({"type": "sequence", "elements": []}, "format type 'sequence'"),
                       ({**fmt["format"], "at_least_one": True}, "'at_least_one' is not supported"),
                       ({**fmt["format"], "tags": [{"begin": "<f>", "content": {"type": "regex", "pattern": "a"},
                                                    "end": "</f>"}]}, "tags[0]: only")):
        with pytest.raises(SamplingParamsError, match=re.escape(words)):
            SamplingParams(structured_outputs=SO(structural_tag={"format": bad}))


def test_structural_tag_through_the_engine(llm):
    tag = {"triggers": ["<f>"], "structures": [{"begin": "<f>", "end": "</f>", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 5}}, "required": ["n"]}}]}
    params = SamplingParams(temperature=1.0, seed=1, n=8, max_tokens=60, structured_outputs=SO(structural_tag=tag))
    for c in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs:
        for body in re.findall(r"<f>(.*?)</f>", c.text, re.S):
            assert 2 <= json.loads(body)["n"] <= 5, c.text


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_is_lossless_under_a_grammar(mtp_ckpt_dir, llm, k):
    spec = SO(grammar=LARK)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    mtp = LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = [o.outputs[0].token_ids for o in mtp.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    assert got == want and mtp.engine.stats().spec_num_draft_tokens > 0


# --- through a real server ------------------------------------------------------------------------------

class Review(BaseModel):
    stars: int = Field(ge=1, le=9)
    ratio: float = Field(gt=0, le=1)
    verdict: str = Field(max_length=12)


def test_openai_parse_of_a_bounded_pydantic_model(openai_server):
    import openai
    client = openai.OpenAI(base_url=openai_server.base_url, api_key="x")
    model = client.models.list().data[0].id
    for seed in range(3):
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "rate it"}],
                                             response_format=Review, max_tokens=80, seed=seed, temperature=1.0)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Review), msg.content
        assert 1 <= msg.parsed.stars <= 9 and 0 < msg.parsed.ratio <= 1


class Pick(BaseModel):
    digit: int = Field(ge=1, le=9)
    word: str = Field(max_length=10)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_of_a_bounded_model(openai_server, method):
    pytest.importorskip("langchain_openai")  # installed in this repository's test environment
    from langchain_openai import ChatOpenAI
    import openai
    model = openai.OpenAI(base_url=openai_server.base_url, api_key="x").models.list().data[0].id
    chat = ChatOpenAI(model=model, base_url=openai_server.base_url, api_key="x", max_tokens=40, temperature=1.0)
    got = chat.with_structured_output(Pick, method=method).invoke("pick a digit")
    assert isinstance(got, Pick) and 1 <= got.digit <= 9


# vLLM's structured-output examples (examples/offline_inference/structured_outputs.py, as its docs give them)
SQL_GBNF = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


CAR = {"type": "object", "properties": {
    "brand": {"type": "string", "title": "Brand"}, "model": {"type": "string", "title": "Model"},
    "car_type": {"$ref": "#/$defs/CarType"}}, "required": ["brand", "model", "car_type"],
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}}}


@pytest.mark.parametrize("spec,check", [
    (SO(choice=["Positive", "Negative"]), lambda t: t in ("Positive", "Negative")),
    (SO(regex=r"\w+@\w+\.com\n"), lambda t: re.fullmatch(r"[0-9A-Za-z_]+@[0-9A-Za-z_]+\.com\n", t)),
    (SO(json=CAR), lambda t: jsonschema.validate(json.loads(t), CAR) is None),
    (SO(grammar=SQL_GBNF), lambda t: re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", t)),
], ids=["choice", "regex", "json", "grammar"])
def test_vllm_examples(llm, spec, check):
    """Outputs that end match; ones cut by max_tokens (the random model writes long strings) are a prefix of
    a match: by the regex module's partial match for the regex and the choice, by a JSON prefix check for the
    schema (GBNF aside: those outputs end)."""
    params = SamplingParams(temperature=0.8, seed=0, n=4, max_tokens=100, structured_outputs=spec)
    prefix = (lambda t: regex_prefix(spec.regex.replace(r"\w", "[0-9A-Za-z_]"), t.encode())) if spec.regex else \
        (lambda t: any(c.startswith(t) for c in spec.choice)) if spec.choice else \
        json_prefix if spec.json else None
    for c in llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)[0].outputs:
        if c.finish_reason == "stop" or prefix is None:
            assert c.finish_reason == "stop" and check(c.text), c.text
        else:
            assert c.finish_reason == "length" and prefix(c.text), c.text


@pytest.mark.parametrize("extra", [{"guided_grammar": GBNF}, {"structured_outputs": {"grammar": LARK}},
                                   {"guided_json": {"type": "integer", "minimum": 3, "maximum": 7}}],
                         ids=["guided_grammar", "structured_outputs.grammar", "bounded-integer"])
def test_grammar_and_bounds_over_http(openai_server, extra):
    import httpx
    body = {"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": 0, "n": 3, **extra}
    r = httpx.post(f"{openai_server.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        t = c["text"]
        assert (re.fullmatch(r"<[a-d]+(,[a-d]+){0,3}>", t) if "guided_grammar" in extra else
                re.fullmatch(r"\([1-9]\d{0,2}([+*][1-9]\d{0,2})*\)", t) if "structured_outputs" in extra else
                3 <= int(t) <= 7), t


def test_a_damaged_grammar_fails_its_request_alone(ckpt_dir):
    from moeserve.protocol import EngineCoreRequest
    from tests.structured.test_compile_off_loop import run
    small = LLM(ckpt_dir("v3"), max_model_len=256, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(grammar='start: "a" /[0-9]+/'))
    damaged = b"LLG1\n" + 'start: "a" ( /[0-9]+/'.encode()  # what no API server sends: the engine's llguidance refuses
    got = run(small.engine, [EngineCoreRequest("damaged", [5, 6], params, [1], structured_grammar=damaged),
                             EngineCoreRequest("fine", [5, 6], SamplingParams(temperature=0, max_tokens=4), [1])])
    assert got["damaged"][0] == [] and "Expected token ')'" in got["damaged"][1], got["damaged"]
    assert got["fine"][1] is None and len(got["fine"][0]) == 4
