"""moeserve vs transformers (the executable reference) on tiny random checkpoints, float32."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from moeserve import LLM, SamplingParams
from tests.checkpoints import VARIANTS

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11]]
NEW_TOKENS = 32


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # Explicit mask: without it transformers infers padding from pad_token_id (0 is also BOS here).
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_prompt_logits_match_transformers(ckpt_dir, variant):
    path = ckpt_dir(variant)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32)  # 32 forces chunked prefill of the long prompt
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, NEW_TOKENS), f"prompt {prompt[:4]}..."

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    ours = llm.engine.score(prompt)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_default_dtype_runs_and_mostly_agrees(ckpt_dir):
    path = ckpt_dir("v3")
    llm = LLM(path, dtype="bfloat16")
    assert llm.engine.runner.dtype == torch.bfloat16
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                     ignore_eos=True))
    ref = hf_greedy(path, PROMPTS[0], 8)
    assert out[0].outputs[0].token_ids[:2] == ref[:2]
