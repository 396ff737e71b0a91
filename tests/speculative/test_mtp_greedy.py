"""MTP speculative decoding is lossless for greedy decoding: the same tokens as without it, any k."""
import pytest

from moeserve import LLM, SamplingParams

# Mixed lengths; the 41-token prompt is prefilled in two chunks under max_num_batched_tokens=32.
PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def baseline(mtp_ckpt_dir):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=32)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.pool.num_free == kv.pool.num_blocks, "KV blocks were not all returned"
    assert not kv.block_tables


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_identical_with_mtp(mtp_ckpt_dir, baseline, k):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", max_num_batched_tokens=32, speculative_config=spec(k))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    stats = llm.engine.stats()
    # Drafts were really verified, at every position, and some were accepted (the lossless path is exercised).
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert len(stats.spec_drafts_per_position) == k and min(stats.spec_drafts_per_position) > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # and some rejected
    assert_no_leak(llm)


def test_greedy_identical_under_preemption_and_stops(mtp_ckpt_dir, baseline):
    """A KV pool too small for all requests forces preemption by recompute; stop tokens and max_tokens cut
    accepted drafts short."""
    stop_tok = baseline[0][9]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop_token_ids=st)
              for m, st in [(24, [stop_tok]), (7, None), (24, None), (13, None), (24, [stop_tok])]]
    plain = LLM(mtp_ckpt_dir("v3"), dtype="float32", num_kv_blocks=9, block_size=8, max_num_batched_tokens=32)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", num_kv_blocks=9, block_size=8, max_num_batched_tokens=32,
              speculative_config=spec(3))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert ref[0][-1] == stop_tok and len(ref[1]) == 7 and len(ref[3]) == 13
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


def test_greedy_identical_v2_lite_and_repeated_shared_head(mtp_ckpt_dir):
    """No q_lora (V2-Lite attention); a checkpoint that repeats embed_tokens / shared_head.head in the MTP
    layer, as DeepSeek-V3's does."""
    for path in (mtp_ckpt_dir("v2_lite"), mtp_ckpt_dir("v3", with_head=True)):
        ref = LLM(path, dtype="float32").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        llm = LLM(path, dtype="float32", speculative_config=spec(2))
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert_no_leak(llm)


def test_logprobs_per_emitted_token(mtp_ckpt_dir, baseline):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = LLM(mtp_ckpt_dir("v3"), dtype="float32").generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", speculative_config=spec(2))
    outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
        for mine, theirs in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_sampling_with_mtp_is_seeded_and_leak_free(mtp_ckpt_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, max_tokens=16, seed=8, ignore_eos=True)]
    runs = []
    for _ in range(2):
        llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", speculative_config=spec(2))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2],
                                                                  sampling_params=params)])
        assert llm.engine.stats().spec_num_draft_tokens > 0
        assert_no_leak(llm)
    assert runs[0] == runs[1] and all(len(t) == 16 for t in runs[0])


def test_greedy_identical_with_int8_quantization(mtp_ckpt_dir):
    """--quantization a8w8 quantizes the MTP layer like the main model; verification stays lossless."""
    path = mtp_ckpt_dir("v3")
    ref = LLM(path, dtype="float32", quantization="a8w8").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(path, dtype="float32", quantization="a8w8", speculative_config=spec(2))
    layer = llm.engine.runner.proposer.mtp.layer
    assert layer.eh_proj.quant_method is not None and layer.self_attn.o_proj.quant_method is not None
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_no_leak(llm)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "a8w8")])
def test_a_repeated_head_is_the_main_heads(mtp_ckpt_dir, monkeypatch, dtype, quant):
    """DeepSeek-V3 ships a copy of lm_head as the MTP layer's shared_head.head: the MTP layer uses the main
    head (as loaded: packed, INT8) instead of a second copy. A head of its own (other values) stays."""
    from safetensors.torch import load_file

    from moeserve.speculative import mtp_model
    from moeserve.speculative.mtp_model import build_mtp

    monkeypatch.setattr(mtp_model, "COMPARE_ROWS", 300)  # several row blocks, the last one partial
    path = mtp_ckpt_dir("v3", with_head=True)
    llm = LLM(path, dtype=dtype, quantization=quant, speculative_config=spec(1))
    runner = llm.engine.runner
    assert runner.proposer.mtp.layer.shared_head.head is None
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    ref = LLM(path, dtype=dtype, quantization=quant).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats().spec_num_accepted_tokens > 0

    tensors = load_file(f"{path}/model.safetensors")
    name = next(n for n in tensors if n.endswith("shared_head.head.weight"))
    mtp = {n: t for n, t in tensors.items() if n.startswith(name.split("shared_head")[0])}
    mtp[name] = mtp[name].flip(0)  # a head of its own
    assert build_mtp(runner.model, mtp, runner.dtype, runner.config.quant).layer.shared_head.head is not None


@pytest.mark.parametrize("k", [1, 3])
def test_stop_strings_with_mtp_keep_no_token_past_the_stop(k):
    """Several tokens arrive per step with MTP; after a stop string only those up to it may be kept
    (token ids, logprobs and usage as without MTP). The bundled model's trained MTP layer is accepted
    often, so a step that completes a stop string usually carries drafts past it."""
    from moeserve.models.default import BUNDLED
    prompts = ["import os\nimport sys\n", "def fibonacci(n):", "class Stack:", "for i in range(10):"]
    plain = LLM(BUNDLED, dtype="float32")
    full = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24))]
    stops = [["\n"]] + [[t[len(t) // 2: len(t) // 2 + 3]] for t in full[1:]]  # "\n": drafts run past it
    params = [SamplingParams(temperature=0, max_tokens=24, stop=st, logprobs=1) for st in stops]
    want = [o.outputs[0] for o in plain.generate(prompts, params)]
    llm = LLM(BUNDLED, dtype="float32", speculative_config=spec(k))
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert [g.finish_reason for g in got] == ["stop"] * len(prompts)
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [len(g.logprobs) for g in got] == [len(w.token_ids) for w in want]
    assert_no_leak(llm)
