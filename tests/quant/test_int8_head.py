"""lm_head under A8W8: an INT8 Linear (per-channel weight scales, per-token activations) like the projections."""
import torch

from moeserve import LLM, SamplingParams
from moeserve.int8 import quantize_per_channel, quantize_per_token

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _exact_int8_logits(hidden: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The A8W8 arithmetic with an exact integer product: INT32 sums, float32 epilogue, model dtype out."""
    xq, xs = quantize_per_token(hidden)
    acc = (xq.long() @ wq.long().t()).float()  # |sum| < 2^24 at these sizes: exact in float32
    return (acc * w_scale.view(1, -1) * xs).to(hidden.dtype).float()


def test_int8_head_logits_equal_the_exact_integer_reference(ckpt_dir):
    llm = LLM(ckpt_dir("v3"), dtype="bfloat16", quantization="a8w8")
    model = llm.engine.runner.model
    head = model.lm_head
    assert head.weight.dtype == torch.int8 and head.weight_scale.shape == (head.out_features, 1)
    hidden = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, _exact_int8_logits(hidden, head.weight, head.weight_scale))
    assert all(len(o.outputs[0].token_ids) == 6
               for o in llm.generate(prompt_token_ids=[[5, 17, 99], [300, 12]], sampling_params=GREEDY))


def test_tied_head_is_an_int8_copy_and_the_embedding_stays_float(ckpt_dir):
    path = ckpt_dir("v3", tie_word_embeddings=True)
    q_llm = LLM(path, dtype="bfloat16", quantization="a8w8")
    model = q_llm.engine.runner.model
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16
    q, s = quantize_per_channel(embed)
    assert torch.equal(model.lm_head.weight, q) and torch.equal(model.lm_head.weight_scale, s)
    q_llm.generate(prompt_token_ids=[[5, 17, 99]], sampling_params=GREEDY)

    float_model = LLM(path, dtype="bfloat16").engine.runner.model
    assert float_model.lm_head.weight is float_model.model.embed_tokens.weight  # one copy, shared
