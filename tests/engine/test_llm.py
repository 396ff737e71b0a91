"""The offline API end to end on a tiny random checkpoint: sampling, stops, preemption, bad input."""
import pytest
import torch

from moeserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 50)), [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256)


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_preemption_with_a_tiny_pool_keeps_outputs(ckpt_dir, llm):
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(24))]
    small = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, num_kv_blocks=8, block_size=8)
    got = small.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(24))
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    assert small.engine.kv.pool.num_free == 8


def test_same_seed_same_output_and_sampling_differs(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    a = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=p)
    b = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=p)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    other = llm.generate(prompt_token_ids=PROMPTS[:2],
                         sampling_params=SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in a]


def test_top_k_1_equals_greedy(llm):
    g = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(10))
    k = llm.generate(prompt_token_ids=PROMPTS,
                     sampling_params=SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in g] == [o.outputs[0].token_ids for o in k]


def test_text_prompt_stop_string_and_logprobs(llm):
    full = llm.generate(["def foo(x):"], greedy(20))[0].outputs[0]
    assert full.text and len(full.token_ids) == 20
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    cut = llm.generate(["def foo(x):"], greedy(20, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.find(stop)]
    lp = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy(5, logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 5
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert tok in entry and len(entry) >= 3
        assert entry[tok] == max(entry.values())  # greedy picks the most likely token
    assert lp.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(lp.token_ids, lp.logprobs)))


def test_n_samples_and_eos(llm):
    out = llm.generate(prompt_token_ids=[PROMPTS[0]],
                       sampling_params=SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True))
    assert len(out[0].outputs) == 3 and all(len(c.token_ids) == 6 for c in out[0].outputs)
    first = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy(8))[0].outputs[0].token_ids
    stopped = llm.generate(prompt_token_ids=[PROMPTS[0]],
                           sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                          stop_token_ids=[first[3]]))[0].outputs[0]
    assert stopped.token_ids == first[: first.index(first[3]) + 1] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=2), "min_p"), (dict(logprobs=100), "logprobs"),
    (dict(top_k=1.5), "top_k must be an integer"), (dict(seed=1.5), "seed must be an integer"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"), (dict(top_k=2**70), "top_k"),
    (dict(min_tokens=2**64), "min_tokens"), (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens .* <= max_tokens"), (dict(temperature="1"), "number"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(temperature=float("inf")), "temperature"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_too_long_and_bad_token_ids(llm):
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate(prompt_token_ids=[list(range(300))], sampling_params=greedy())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=greedy())
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(max_num_seq=3)


def test_sampler_filters_match_definitions():
    from moeserve.sample import apply_filters

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = torch.softmax(logits, -1)
    kept = apply_filters(logits, SamplingParams(top_p=float(p[0] + p[1]) - 1e-4)).isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    kept = apply_filters(logits, SamplingParams(top_k=3)).isfinite()
    assert kept.tolist() == [True, True, True, False, False]
    kept = apply_filters(logits, SamplingParams(min_p=float(p[2] / p[0]) - 1e-4)).isfinite()
    assert kept.tolist() == [True, True, True, False, False]
    # A top_p that rounds to 0 in float32 still keeps the best token (it used to mask all and give NaN).
    for tiny in (1e-46, 1e-300):
        assert apply_filters(logits, SamplingParams(top_p=tiny)).isfinite().tolist() == [True] + [False] * 4


def test_child_seeds_wrap_into_64_bits():
    p = SamplingParams(n=3, seed=2**63 - 2)
    assert [p.child_seed(i) for i in range(3)] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert SamplingParams().child_seed(1) is None


def test_min_tokens_masks_stop_tokens_and_stop_strings(llm):
    first = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy(8))[0].outputs[0].token_ids
    stop = first[0]
    # Without min_tokens the first token stops the request; with it the stop token cannot be drawn
    # before 3 tokens are out (and it is then never in the output before the end).
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[stop]))[0].outputs[0].token_ids == [stop]
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[stop], min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) >= 3 and stop not in out.token_ids[:3]
    assert stop not in out.token_ids[:-1]
    text = llm.generate(["def foo(x):"], greedy(12))[0].outputs[0]
    s = text.text[:2]
    cut = llm.generate(["def foo(x):"], greedy(12, stop=[s], min_tokens=12))[0].outputs[0]
    assert cut.text == text.text and cut.finish_reason == "length"


def test_stop_strings_before_min_tokens_do_not_count(llm):
    full = llm.generate(["def foo(x):"], greedy(12))[0].outputs[0]
    # A stop string that occurs only in the text of the first two tokens.
    head = llm.get_tokenizer().decode(full.token_ids[:2])
    stop = next(head[:k] for k in range(1, len(head) + 1) if full.text.find(head[:k], 1) == -1)
    assert llm.generate(["def foo(x):"], greedy(12, stop=[stop]))[0].outputs[0].text == ""
    late = llm.generate(["def foo(x):"], greedy(12, stop=[stop], min_tokens=3))[0].outputs[0]
    assert late.text == full.text and late.finish_reason == "length"


def test_huge_temperature_with_min_tokens_samples_uniformly_instead_of_failing(llm):
    out = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        temperature=1e39, min_tokens=2, max_tokens=3, seed=1))[0].outputs[0]
    assert len(out.token_ids) >= 2


def test_logprobs_are_the_raw_model_distribution_under_logit_bias(llm):
    plain = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=greedy(1, logprobs=5))[0].outputs[0]
    target = (plain.token_ids[0] + 7) % 100 + 3
    biased = llm.generate(prompt_token_ids=[PROMPTS[1]],
                          sampling_params=greedy(1, logprobs=5, logit_bias={target: 100.0}))[0].outputs[0]
    assert biased.token_ids == [target]
    assert {t: round(v, 4) for t, v in biased.logprobs[0].items() if t != target} == \
        {t: round(v, 4) for t, v in plain.logprobs[0].items() if t != target}
    assert biased.logprobs[0][target] < -1.0   # its raw logprob, not ~0 as under the bias


def test_logit_bias_forces_a_token(llm):
    g = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=greedy(4))[0].outputs[0].token_ids
    target = (g[0] + 7) % 100 + 3
    out = llm.generate(prompt_token_ids=[PROMPTS[1]],
                       sampling_params=greedy(4, logit_bias={target: 100.0}))[0].outputs[0].token_ids
    assert out == [target] * 4
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=greedy(4, logit_bias={10**6: 1.0}))
    assert not llm.engine.has_unfinished()


def test_an_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    calls = {"n": 0}
    real = llm.engine.step

    def interrupted():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(16))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_a_rejected_prompt_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[PROMPTS[0], list(range(300))], sampling_params=greedy())
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_score_refused_for_a_full_pool_leaves_no_block_table(ckpt_dir):
    from moeserve.engine.scheduler import RequestRejected
    from moeserve.protocol import EngineCoreRequest
    eng = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=32, num_kv_blocks=4, block_size=8).engine
    eng.add_request(EngineCoreRequest("busy", list(range(20, 50)), greedy(2), []))
    eng.step()  # its prompt holds all 4 blocks
    with pytest.raises(RequestRejected, match="no free KV blocks"):
        eng.score(list(range(60, 80)))
    assert list(eng.kv.block_tables) == ["busy"]
    while eng.has_unfinished():
        eng.step()
    assert not eng.kv.block_tables and eng.kv.pool.num_free == 4


def test_chat_renders_like_the_server_and_generates(ckpt_dir):
    """LLM.chat: the prompt is the chat template's rendering (the default one for this checkpoint), the
    tokens are what generate() gives for those ids; bad messages name the conversation and message."""
    from moeserve.chat_template import render, resolve_template
    llm = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    out = llm.chat(conv, greedy)[0]
    text, ids = render(llm.get_tokenizer(), [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}], resolve_template(llm.get_tokenizer()))
    assert out.prompt == text and out.prompt_token_ids == ids and text.endswith("assistant:")
    assert out.outputs[0].token_ids == llm.generate(prompt_token_ids=[ids], sampling_params=greedy)[0].outputs[0].token_ids
    assert len(llm.chat([conv, conv[1:]], greedy)) == 2
    with pytest.raises(ValueError, match="conversation 0, message 1"):
        llm.chat([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}])
