"""INT8 kernels and layers against float references."""
import pytest
import torch

from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.quant import (QMAX, Int8FusedExperts, dequantize, int8_linear, int8_mm, quantize_per_channel,
                                   quantize_per_token)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(1, 48, 40), (7, 64, 96), (33, 1030, 24), (5, 2100, 8)])
def test_int8_mm_exact_against_int64_reference(shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    ref = (a.long() @ w.long().t()).to(torch.int32)
    assert torch.equal(int8_mm(a, w), ref)
    assert torch.equal(int8_mm(a, w, force_fallback=True), ref)  # K > 1024 exercises the chunked sum
    out = torch.full((m + 2, n), -1, dtype=torch.int32)
    int8_mm(a, w, out=out[1:m + 1])
    assert torch.equal(out[1:m + 1], ref) and (out[0] == -1).all() and (out[-1] == -1).all()


def test_per_channel_round_trip_error_is_within_half_a_step():
    w = torch.randn(64, 300) * torch.logspace(-3, 1, 64)[:, None]  # rows spanning four decades
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64, 1) and s.dtype == torch.float32
    assert q.abs().max() <= QMAX and q.abs().amax(dim=1)[torch.arange(64) != 3].min() == QMAX
    err = (dequantize(q, s) - w).abs()
    assert (err <= s / 2 + 1e-7).all()
    assert torch.equal(dequantize(q, s)[3], torch.zeros(300))
    # quantizing the dequantized weight again is the identity (what `moeserve quantize` relies on)
    q2, s2 = quantize_per_channel(dequantize(q, s))
    assert torch.equal(q2, q) and torch.allclose(s2, s)


def test_per_token_scales_are_per_row():
    x = torch.randn(5, 32)
    x[2] *= 1000
    q, s = quantize_per_token(x)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s[:, 0], x.abs().amax(dim=1) / QMAX)
    assert (q.abs().amax(dim=1) == QMAX).all()
    assert ((dequantize(q, s) - x).abs() <= s * 0.5001).all()  # the fast path rounds to nearest, no overflow
    qb, sb = quantize_per_token(x.to(torch.bfloat16))
    assert qb.dtype == torch.int8 and sb.dtype == torch.float32
    assert (quantize_per_token(torch.zeros(2, 8))[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_close_to_float_linear(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 256, generator=g).to(dtype)
    w = torch.randn(128, 256, generator=g) * 0.05
    b = torch.randn(128, generator=g)
    q, s = quantize_per_channel(w)
    y = int8_linear(x, q, s, b)
    assert y.dtype == dtype and y.shape == (9, 128)
    ref = x.float() @ w.t() + b
    # Two 8-bit roundings (x and w) on 256-term dot products: ~1% relative error, bound at 2.5%.
    assert _rel_err(y, ref) < 0.025
    # Exactly the float GEMM of the dequantized operands (INT32 accumulation loses nothing).
    xq, xs = quantize_per_token(x.float())
    exact = dequantize(xq, xs) @ dequantize(q, s).t() + b
    if dtype == torch.float32:
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)
    assert int8_linear(x[:0], q, s).shape == (0, 128)


def test_int8_linear_keeps_leading_dims():
    q, s = quantize_per_channel(torch.randn(16, 32))
    assert int8_linear(torch.randn(2, 3, 32), q, s).shape == (2, 3, 16)


def _experts_pair(e=6, h=64, i=32, seed=0):
    torch.manual_seed(seed)
    ref = FusedExperts(e, h, i)
    ref.w13.data.normal_(0, 0.1)
    ref.w2.data.normal_(0, 0.1)
    q = Int8FusedExperts.like(ref)
    for slot in range(e):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q.load_expert(slot, proj, "weight", ref.expert_weight(slot, proj), f"e{slot}.{proj}")
    return ref, q


def test_int8_experts_match_float_experts():
    ref, q = _experts_pair()
    n = 40
    x = torch.randn(n, 64)
    ids = torch.randint(-1, 6, (n,))  # -1: rows routed to another rank stay zero
    ids[:3] = 4  # one expert with several rows, one (5 possibly) with none
    weights = torch.rand(n)
    with torch.no_grad():
        y_ref, y = ref(x, ids, weights), q(x, ids, weights)
    assert (y[ids == -1] == 0).all()
    assert _rel_err(y, y_ref) < 0.03
    # and equal to the float experts built from the dequantized INT8 weights, up to activation rounding
    deq = FusedExperts(6, 64, 32)
    deq.w13.data, deq.w2.data = q.dequantized()
    with torch.no_grad():
        assert _rel_err(y, deq(x, ids, weights)) < 0.02


def test_int8_experts_empty_and_all_remote():
    _, q = _experts_pair()
    assert q(torch.randn(0, 64), torch.zeros(0, dtype=torch.long), torch.zeros(0)).shape == (0, 64)
    x = torch.randn(4, 64)
    assert (q(x, torch.full((4,), -1), torch.ones(4)) == 0).all()


def test_compiled_quantizer_is_bit_identical_to_the_eager_one(monkeypatch):
    """Prefill-sized inputs go through one inductor kernel once an engine compiles (int8.compile_quantizer);
    it must give the eager passes' bits: same rounding (half to even), same scale, zero rows included."""
    from moeserve import int8

    monkeypatch.setattr(int8, "_compiled", None)
    int8.compile_quantizer()
    g = torch.Generator().manual_seed(7)
    for rows, k, dtype in [(64, 96, torch.bfloat16), (300, 1030, torch.float32), (1024, 2048, torch.bfloat16),
                           (65, 256, torch.float32)]:
        x = (torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
        x[1] = 0.0  # an all-zero row
        x[2, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # q = x * 127 / 127: exact .5 ties round to even
        q, s = int8.quantize_per_token(x)
        q_ref, s_ref = int8._quantize_per_token(x)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (rows, k, dtype)
    small = torch.randn(int8.COMPILED_MIN_ROWS - 1, 32, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(int8.quantize_per_token(small), int8._quantize_per_token(small)))


def _int8_experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int = 0) -> Int8FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = Int8FusedExperts(e, h, i)
    for w, s, shape in ((ex.w13, ex.w13_scale, (e, 2 * i, h)), (ex.w2, ex.w2_scale, (e, h, i))):
        q, scale = quantize_per_channel(torch.randn(*shape, generator=g))
        w.data.copy_(q)
        s.data.copy_(scale[..., 0])
    ex.act_dtype = dtype
    ex.process_weights_after_loading(fused_kernels=False)
    return ex


@pytest.mark.parametrize("e,h,i,t,k,dtype", [
    (16, 256, 64, 1, 6, torch.bfloat16), (16, 256, 64, 3, 2, torch.float32),
    (8, 2100, 32, 2, 4, torch.bfloat16),  # K > 1024 on the first GEMM: chunks summed in int32
], ids=["bf16", "float32", "long-rows"])
def test_gathered_int8_experts_in_a_graph_have_the_eager_bits(e, h, i, t, k, dtype):
    """The decode graph's INT8 experts (gathered_topk, traced by inductor) against the eager per-expert GEMMs
    (oneDNN's packed INT8 GEMMs where they run, torch._int_mm otherwise): the same bits, including experts
    shared by several tokens."""
    from moeserve.engine.compiled_decode import INDUCTOR_OPTIONS
    from moeserve.layers.quant import int8_rows_dot

    ex = _int8_experts(e, h, i, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[-1, 0] = ids[0, 0]  # one expert busy with two tokens
    w = torch.rand(t, k, generator=g)
    # compiled as the engine compiles its decode graphs: rounding to the model dtype where the code says so
    compiled = torch.compile(ex.gathered_topk, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
    assert torch.equal(compiled(x, ids, w), ex.forward_topk(x, ids, w))
    # the dot product itself against an int64 reference, eagerly too
    a = torch.randint(-128, 128, (3, h), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (3, 5, h), dtype=torch.int8, generator=g)
    ref = torch.einsum("pnk,pk->pn", wq.long(), a.long()).float()
    assert torch.equal(int8_rows_dot(a, wq), ref)


def test_int8_experts_gather_only_few_pairs_and_where_swiglu_matches():
    ex = _int8_experts(16, 64, 64, torch.bfloat16)
    limit = int(Int8FusedExperts.GATHER_PAIRS_PER_SLOT * 16)
    assert ex.traceable(limit) and not ex.traceable(limit + 1)
    assert not _int8_experts(16, 64, 48, torch.bfloat16).traceable(1)  # SwiGLU rows of 48: not the eager bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_expert_gemms_write_the_model_dtype_rounded_once(dtype):
    """Each expert GEMM's output in the model's dtype (BF16 for a BF16 model): the exact INT32 sums times the
    weight scale in float32, rounded once, whether oneDNN's packed GEMM (where it runs: always with AMX) or
    torch._int_mm computes it."""
    from moeserve.layers.quant import expert_out_dtype

    e, h, i, rows = 4, 256, 128, 24
    ex = _int8_experts(e, h, i, dtype)
    g = torch.Generator().manual_seed(2)
    aq = torch.randint(-128, 128, (rows, h), dtype=torch.int8, generator=g)
    bounds = [0, 5, 5, 17, rows]  # expert 1 idle
    ids = torch.repeat_interleave(torch.arange(e), torch.tensor([5, 0, 12, 7]))
    ref = (torch.einsum("rk,rnk->rn", aq.long(), ex.w13[ids].long()).float() * ex.w13_scale[ids]).to(dtype)
    assert expert_out_dtype(dtype) == dtype
    for packed in (getattr(ex, "packed", None), None):
        y = Int8FusedExperts._grouped_mm(aq, ex.w13, ex.w13_scale, bounds, packed, 0, ids, None, dtype)
        assert y.dtype == dtype and torch.equal(y, ref)
