"""lm_head under A8W8: an INT8 Linear (per-channel weight scales, per-token activations) like the projections,
whose top candidates per row are re-scored with unquantized activations (layers/logits_head.py)."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.int8 import quantize_per_channel, quantize_per_token
from moeserve.layers import logits_head
from moeserve.layers.logits_head import TOP_CANDIDATES, rescore_top, top_candidates

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
    int8 = _exact_int8_logits(hidden, head.weight, head.weight_scale)
    assert torch.equal(head(hidden).float(), int8)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    top = int8.topk(TOP_CANDIDATES, dim=-1).indices
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(logits[rest], int8[rest])  # the rest of the vocabulary as the INT8 GEMM gave it
    w8a16 = hidden.float() @ (head.weight.float() * head.weight_scale).t()
    # rounded to BF16, as the head writes every other logit (within one BF16 step of this reference's sum)
    assert torch.equal(logits, logits.to(torch.bfloat16).float())
    torch.testing.assert_close(logits.gather(-1, top), w8a16.gather(-1, top), rtol=2 ** -8, atol=1e-4)
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


def _noisy_case(seed: int, rows: int = 6, vocab: int = 500, hidden: int = 64):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randint(-127, 128, (vocab, hidden), generator=g, dtype=torch.int8)
    scale = torch.rand(vocab, 1, generator=g) * 1e-3 + 1e-4
    x = torch.randn(rows, hidden, generator=g)
    exact = x @ (wq.float() * scale).t()
    # the INT8 GEMM's logits: off by less than the gaps near the top of each row, so the exact best token
    # is among the candidates, but not always the noisy argmax
    noisy = exact + 0.025 * exact.std() * torch.randn(exact.shape, generator=g)
    return x, wq, scale, exact, noisy


@pytest.mark.parametrize("seed", range(4))
def test_rescored_candidates_take_the_exact_logits_and_the_rest_stay(seed):
    x, wq, scale, exact, noisy = _noisy_case(seed)
    top = noisy.topk(TOP_CANDIDATES, dim=-1).indices
    assert torch.isin(exact.argmax(-1), top).all()  # the case is one the re-scoring can mend
    logits = noisy.clone()
    rescore_top(logits, x, wq, scale)
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(logits[rest], noisy[rest])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_rescoring_mends_argmax_flips():
    """Over many rows the noisy logits pick another token somewhere; the re-scored ones never do."""
    x, wq, scale, exact, noisy = _noisy_case(7, rows=200)
    assert (noisy.argmax(-1) != exact.argmax(-1)).any()
    rescore_top(noisy, x, wq, scale)
    assert torch.equal(noisy.argmax(-1), exact.argmax(-1))


def test_rescoring_takes_a_bias_and_no_rows():
    x, wq, scale, exact, noisy = _noisy_case(3)
    bias = torch.randn(wq.shape[0])
    logits = noisy + bias
    rescore_top(logits, x, wq, scale, bias)
    top = (noisy + bias).topk(TOP_CANDIDATES, dim=-1).indices
    torch.testing.assert_close(logits.gather(-1, top), (exact + bias).gather(-1, top), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, wq.shape[0])
    rescore_top(empty, x[:0], wq, scale)
    assert empty.shape == (0, wq.shape[0])


@pytest.mark.parametrize("vocab,k", [(4096, 8), (32000, 8), (1000, 8), (512, 8), (256, 3), (129280, 1)])
def test_top_candidates_are_the_topk_set(vocab, k):
    """Chunked search (whole chunks of 128) or topk: the same k indices as torch.topk, ties aside."""
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[0, -k:] = 50.0 + torch.arange(k)  # the top all in the last chunk
    got = top_candidates(logits, k)
    assert torch.equal(got.sort(-1).values, logits.topk(k, dim=-1).indices.sort(-1).values)


def test_rescoring_in_row_blocks_equals_one_block(monkeypatch):
    """Many rows (a prefill with prompt logprobs) go through row blocks: the same logits as in one block."""
    x, wq, scale, exact, noisy = _noisy_case(5, rows=50)
    whole = noisy.clone()
    rescore_top(whole, x, wq, scale)
    monkeypatch.setattr(logits_head, "CHUNK_ELEMENTS", TOP_CANDIDATES * x.shape[1] * 7)  # blocks of 7 rows
    blocks = noisy.clone()
    rescore_top(blocks, x, wq, scale)
    assert torch.equal(blocks, whole)
