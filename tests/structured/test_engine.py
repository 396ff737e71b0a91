"""Structured output through the engine: greedy decoding equals a hand loop that masks the model's own
logits with a brute-force per-token check (the regex module's partial match, a choice's strings); MTP and
preemption change nothing; sampled outputs are valid (re, jsonschema)."""
import json
import re

import jsonschema
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.sampling_params import SamplingParamsError
from moeserve.structured.grammar import token_bytes
from moeserve.structured.params import StructuredOutputsParams as SO
from tests.structured.oracle import json_prefix, regex_full, regex_prefix

# Finite: every output ends (with EOS) within max_tokens. The hand loop also runs an unbounded integer.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 22]},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "ok", "kind"]}
OPEN_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "x": {"type": ["number", "null"]}}}
SPECS = [SO(json=SCHEMA), SO(regex=r"[a-f]{2,6}-\d{2}"), SO(choice=["alpha", "beta", "alphabet"]), SO(json_object=True)]
PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61))]


@pytest.fixture(scope="module")
def llm(mtp_ckpt_dir):
    return LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False)


def _hand_loop(llm: LLM, prompt: list[int], spec: SO, max_tokens: int) -> list[int]:
    """Greedy over the engine's logits, allowing a token iff its bytes keep the output a prefix of a match
    (checked token by token: the regex module's partial match, or a choice's strings), and EOS iff the output
    so far matches."""
    if spec.regex is not None:
        prefix, full = (lambda t: regex_prefix(spec.regex, t)), (lambda t: regex_full(spec.regex, t))
    else:
        prefix = lambda t: any(c.encode().startswith(t) for c in spec.choice)  # noqa: E731
        full = lambda t: t in [c.encode() for c in spec.choice]  # noqa: E731
    pieces = token_bytes(llm.get_tokenizer(), llm.arch.vocab_size)
    out: list[int] = []
    text = b""
    for _ in range(max_tokens):
        logits = llm.engine.score(prompt + out)[-1].clone()
        allowed = torch.tensor([p is not None and prefix(text + p) for p in pieces])
        if full(text):
            allowed[llm.eos_token_ids] = True
        logits[~allowed] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token in llm.eos_token_ids:
            break
        text += pieces[token]
    return out


@pytest.mark.parametrize("spec", SPECS[1:3], ids=lambda s: s.describe())
def test_greedy_equals_a_masked_hand_loop(llm, spec):
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    got = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    assert got.token_ids == _hand_loop(llm, PROMPTS[0], spec, 80) and got.finish_reason == "stop"


@pytest.mark.parametrize("spec", [SO(json=SCHEMA), SO(json=OPEN_SCHEMA)], ids=["closed", "open"])
def test_greedy_json_validates(llm, spec):
    """JSON Schema has no per-token oracle here: the greedy output validates (jsonschema), or, cut by
    max_tokens (the open schema's unbounded integer), is a JSON prefix."""
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    got = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    if got.finish_reason == "stop":
        jsonschema.validate(json.loads(got.text), json.loads(spec.json))
    else:
        assert spec.json == json.dumps(OPEN_SCHEMA) and json_prefix(got.text), got.text


def _check(text: str, spec: SO) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text, re.ASCII), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.describe())
def test_sampled_outputs_match_their_pattern(llm, spec):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3, n=6, max_tokens=80, structured_outputs=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            _check(c.text, spec)


def test_json_object_output_is_an_object_prefix_or_object(llm):
    params = SamplingParams(temperature=0.8, seed=0, n=4, max_tokens=48, structured_outputs=SPECS[3])
    for c in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs:
        if c.finish_reason == "stop":
            _check(c.text, SPECS[3])
        else:  # cut by max_tokens: still a JSON prefix
            assert json_prefix(c.text), c.text
        assert c.text.startswith("{")


def test_mixed_batch_leaves_other_requests_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=PROMPTS, sampling_params=plain)
    guided = SamplingParams(temperature=0, max_tokens=80, structured_outputs=SPECS[0])
    mixed = llm.generate(prompt_token_ids=PROMPTS + PROMPTS[:1], sampling_params=[plain] * 3 + [guided])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    _check(mixed[3].outputs[0].text, SPECS[0])


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_is_lossless_under_structured_output(mtp_ckpt_dir, llm, k):
    spec_llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False,
                   speculative_config={"method": "mtp", "num_speculative_tokens": k})
    for spec in SPECS[:3]:
        params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
        want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        got = [o.outputs[0].token_ids for o in spec_llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert got == want, spec.describe()
    assert spec_llm.engine.stats().spec_num_draft_tokens > 0


def test_preemption_changes_nothing(mtp_ckpt_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=SPECS[0])
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS * 2, sampling_params=params)]
    small = LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False, num_kv_blocks=20, block_size=8)
    got = [o.outputs[0].token_ids for o in small.generate(prompt_token_ids=PROMPTS * 2, sampling_params=params)]
    assert got == want
    assert small.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("kw,words", [
    (dict(regex="(a"), "unclosed group"), (dict(json={"type": "integer", "minimum": 5, "maximum": 3}), "maximum"),
    (dict(grammar="root ::= 'a'"), "GBNF|Lark|name"), (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "choice"),
])
def test_bad_specs_are_refused_naming_the_field(kw, words):
    with pytest.raises((SamplingParamsError, ValueError), match=words):
        SamplingParams(structured_outputs=SO(**kw))


def test_ignore_eos_keeps_eos_out_until_the_pattern_is_complete(llm):
    params = SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=12, ignore_eos=True,
                            structured_outputs=SO(regex="[ab]{1,6}"))
    eos = set(llm.eos_token_ids)
    for c in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 12
        first_eos = next(i for i, t in enumerate(c.token_ids) if t in eos)  # only once "[ab]{6}" is complete
        assert all(t in eos for t in c.token_ids[first_eos:])
        assert re.fullmatch("[ab]{6}", c.text)  # EOS was not allowed earlier: ignore_eos


@pytest.mark.parametrize("k", [0, 2])
def test_pattern_starts_after_the_marker(mtp_ckpt_dir, llm, k):
    # "after" is how the server starts a pattern once a reasoning model writes </think>; the tiny model
    # writes no such marker, so a frequent byte ("e") stands in for it: free text up to it, the pattern after.
    spec = SO(regex=r"[a-f]{2,4}-\d", after="e")
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
    engine = llm if not k else LLM(mtp_ckpt_dir("v3"), dtype="float32", enable_prefix_caching=False,
                                   speculative_config={"method": "mtp", "num_speculative_tokens": k})
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    free, ended = 0, 0
    for o in outs:
        c = o.outputs[0]
        head, marker, tail = c.text.partition("e")
        if marker:
            assert re.fullmatch(r"[a-f]{2,4}-\d", tail), c.text
            assert c.finish_reason == "stop"
            ended += 1
        free += len(head)
    assert ended and free  # some free text before the marker, and the pattern completed after it
    if k:  # lossless: the same tokens as without MTP
        assert [o.outputs[0].token_ids for o in outs] == \
            [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_yields_to_a_complete_pattern(llm, temperature):
    # "yes" is complete after a few tokens and nothing may follow, while min_tokens masks EOS: the row had
    # no finite logit left (greedy emitted token 0 until min_tokens, sampling raised)
    params = SamplingParams(temperature=temperature, seed=1, n=4, max_tokens=20, min_tokens=10,
                            structured_outputs=SO(choice=["yes", "no"]))
    for c in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs:
        assert c.finish_reason == "stop" and c.text in ("yes", "no")
        assert c.token_ids[-1] in llm.eos_token_ids and len(c.token_ids) < 10
    # a pattern that can go on still honours min_tokens
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=SO(regex="[a-z]+"))
    assert len(llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0].token_ids) >= 10


def test_a_stop_token_with_text_ends_the_output_only_as_a_match(llm):
    pieces = token_bytes(llm.get_tokenizer(), llm.arch.vocab_size)
    first = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, structured_outputs=SO(regex="[a-z]{10,20}"))).pop().outputs[0].token_ids[0]
    assert pieces[first] and len(pieces[first]) < 10  # the greedy first token, e.g. b"name"
    # its text stays in the output: stopping on it at once left a 4-letter output that does not match
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first],
                            structured_outputs=SO(regex="[a-z]{10,20}"))
    c = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    assert c.finish_reason == "stop" and re.fullmatch("[a-z]{10,20}", c.text), c
    # where output + its text match, it may end the output
    word = pieces[first].decode()
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first],
                            structured_outputs=SO(regex=f"({word})+"))
    c = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == first and c.text == word


def test_logprobs_are_the_raw_model_distribution(llm):
    # as for logit_bias and the other logits processors (and vLLM's default): not the masked distribution
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, structured_outputs=SO(regex="[a-z]{3,20}"))
    c = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        raw = llm.engine.score(PROMPTS[0] + c.token_ids[:i])[-1].float().log_softmax(-1)
        assert lp[t] == pytest.approx(float(raw[t]), abs=1e-4)
        assert set(raw.topk(3).indices.tolist()) <= set(lp)


def test_allowed_token_ids_and_structured_output_both_apply(llm):
    """allowed_token_ids was dropped silently whenever no allowed token was one the grammar allows (the row
    of -inf went to the grammar alone). Both apply now: the output keeps to the allowed tokens and matches."""
    pieces = token_bytes(llm.get_tokenizer(), llm.arch.vocab_size)
    one = {p: t for t, p in enumerate(pieces) if p in (b"1", b"2", b"a")}
    assert len(one) == 3, one
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex="[0-9]{3,8}"),
                            allowed_token_ids=[one[b"1"], one[b"2"]])
    c = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)[0].outputs[0]
    # EOS is not allowed, so the digits go on to the pattern's end; there the output matches and nothing else
    # can follow: EOS ends it as a match (as with min_tokens)
    assert re.fullmatch("[12]{8}", c.text) and c.finish_reason == "stop", c
    assert set(c.token_ids[:-1]) <= {one[b"1"], one[b"2"]} and c.token_ids[-1] in llm.eos_token_ids
    sampled = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=20, allowed_token_ids=[one[b"1"], one[b"2"]],
                             structured_outputs=SO(choice=["12", "21", "3"]))
    for c in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=sampled)[0].outputs:
        assert c.text in ("12", "21"), c  # never "3": its token is not allowed
    # no token both allow: the request fails saying so, instead of the grammar alone choosing
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=SO(regex="[0-9]+"),
                            allowed_token_ids=[one[b"a"]])
    with pytest.raises(ValueError, match="structured output together allow no token"):
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)
    ok = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(temperature=0, max_tokens=3))
    assert len(ok[0].outputs[0].token_ids) == 3  # the engine serves on
