"""Routed A8W8 experts through zentorch's INT8 fused MoE (Int8FusedExperts on layers/moe/zen.py) against the
per-expert INT8 path, and the weight-cache discipline that keeps it from computing with weights that are no
longer there; A8W8 Linears through zentorch's dynamic-quantization INT8 linear against the exact INT8 path.

These run where zentorch's fused MoE is available (an AMD CPU with zentorch installed); elsewhere the module
is skipped, and the experts run on the per-expert path the other tests cover."""
import gc

import pytest
import torch

from moeserve.int8 import quantize_per_channel
from moeserve.layers.linear import packed_copy_bytes
from moeserve.layers.moe import zen
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.quant import Int8FusedExperts
from tests.quant.helpers import int8_linear_layer

pytestmark = pytest.mark.skipif(not zen.available(), reason="zentorch's fused MoE is not available here")


@pytest.fixture(autouse=True)
def _zentorch_alone(monkeypatch):
    """The A8W8 Linears on zentorch's INT8 linear alone: where vLLM's library also loads, layers keep its copy
    too and take it for few rows (tests/layers/test_amx_linear.py tests that split)."""
    from moeserve.layers import amx_linear
    monkeypatch.setattr(amx_linear, "available", lambda: False)


def _fill(ex: Int8FusedExperts, seed: int, scale: float = 0.1) -> Int8FusedExperts:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w, s in ((ex.w13, ex.w13_scale), (ex.w2, ex.w2_scale)):
            q, sc = quantize_per_channel(torch.randn(w.shape, generator=g) * scale)
            w.copy_(q)
            s.copy_(sc[..., 0])
    return ex


def _experts(num: int, hidden: int, inter: int, seed: int, scale: float = 0.1, zentorch: bool = True):
    ex = _fill(Int8FusedExperts(num, hidden, inter), seed, scale)
    ex.process_weights_after_loading(fused_kernels=zentorch)
    return ex


def _reference(ex: Int8FusedExperts, x, ids, weights):
    """The per-expert INT8 path (no zentorch) on a copy of the same weights."""
    ref = Int8FusedExperts(ex.num_local_experts, ex.w13.shape[-1], ex.intermediate)
    ref.load_state_dict(ex.state_dict())
    ref.process_weights_after_loading(fused_kernels=False)
    assert not ref.fused
    with torch.no_grad():
        return ref.forward_topk(x, ids, weights)


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within INT8 rounding of two quantizing kernels and BF16 output rounding: 3% of the output's scale
    (measured up to ~1.1%; stale weights differ by ~100%)."""
    diff = (y.float() - ref.float()).abs().max().item()
    assert diff <= 0.03 * ref.float().abs().max().item(), diff


def _routing(t: int, k: int, num: int, hidden: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, hidden, generator=g).to(dtype), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("shape", [(8, 64, 32, 3), (64, 1024, 256, 6)], ids=["small", "bench"])
@pytest.mark.parametrize("t", [1, 5, 32, 300])
def test_fused_moe_int8_matches_the_per_expert_path(shape, t):
    num, hidden, inter, k = shape
    ex = _experts(num, hidden, inter, t)
    assert ex.fused and ex.packed is None and packed_copy_bytes(ex) == ex.w13.nbytes + ex.w2.nbytes
    x, ids, weights = _routing(t, k, num, hidden, t)
    with torch.no_grad():
        y = ex.forward_topk(x, ids, weights)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    _assert_close(y, _reference(ex, x, ids, weights))


def test_rows_of_other_ranks_are_zero_and_the_rest_match():
    """The row interface (all-to-all / all-gather dispatch): one expert per row, -1 = another rank's row."""
    ex = _experts(8, 64, 32, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (20,), generator=g)
    ids[0], ids[1] = -1, 2
    weights = torch.rand(20, generator=g)
    with torch.no_grad():
        y = ex(x, ids, weights)
        assert (y[ids == -1] == 0).all()
        mine = ids >= 0
        _assert_close(y[mine], _reference(ex, x[mine], ids[mine, None], weights[mine, None]))
        assert ex(x, torch.full((20,), -1), weights).abs().sum() == 0
        assert ex(x[:0], ids[:0], weights[:0]).shape == (0, 64)


def test_float32_activations_keep_the_exact_path_unless_the_model_is_bf16():
    """zentorch's kernel takes BF16 activations: float32 inputs of a float32 (or unknown) model stay on the
    per-expert path, bit for bit; a BF16 model's float32 rows (a decoded INT8 dispatch payload) go through
    zentorch as BF16 and come back float32."""
    ex = _experts(8, 64, 32, 12)
    x, ids, weights = _routing(6, 2, 8, 64, 13, dtype=torch.float32)
    with torch.no_grad():
        ref = _reference(ex, x, ids, weights)
        assert torch.equal(ex.forward_topk(x, ids, weights), ref)
        ex.act_dtype = torch.bfloat16
        y = ex.forward_topk(x, ids, weights)
        assert y.dtype == torch.float32 and not torch.equal(y, ref)
        _assert_close(y, ref)
        rows = ex(x.repeat_interleave(2, 0), ids.reshape(-1), weights.reshape(-1))
        assert rows.dtype == torch.float32
        _assert_close(rows.view(6, 2, 64).sum(1), ref)
    float32_model = Int8FusedExperts.like(FusedExperts(8, 64, 32))
    assert float32_model.act_dtype == torch.float32
    _fill(float32_model, 12).process_weights_after_loading()
    assert not float32_model.fused  # keeps the per-expert path (and its oneDNN packs where they pay)
    bf16_model = Int8FusedExperts.like(FusedExperts(8, 64, 32).to(torch.bfloat16))
    _fill(bf16_model, 12).process_weights_after_loading()
    assert bf16_model.fused and bf16_model.act_dtype == torch.bfloat16


def test_weights_moved_in_place_are_used_after_process_weights():
    """zentorch keeps each expert's reordered INT8 weights by address (in its MoE weight cache, which
    zentorch_clear_weight_cache alone does not clear): an EPLB move writes new weights at the same address and
    calls process_weights_after_loading, which must flush them (else the old ones are used)."""
    ex = _experts(8, 64, 32, 5)
    x, ids, weights = _routing(16, 2, 8, 64, 6)
    with torch.no_grad():
        before = ex.forward_topk(x, ids, weights)
        new = _experts(8, 64, 32, 7, zentorch=False)
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            getattr(ex, name).copy_(getattr(new, name))
        ex.process_weights_after_loading()
        after = ex.forward_topk(x, ids, weights)
    assert not torch.allclose(before.float(), after.float(), atol=1e-2)
    _assert_close(after, _reference(ex, x, ids, weights))


def test_the_bf16_flush_alone_would_leave_int8_weights_stale():
    """Why flush_cache clears zentorch's MoE weight cache too: with zentorch_clear_weight_cache alone (what the
    BF16 experts need), moved INT8 weights compute stale."""
    ex = _experts(8, 64, 32, 20)
    x, ids, weights = _routing(8, 2, 8, 64, 21)
    with torch.no_grad():
        before = ex.forward_topk(x, ids, weights)
        new = _experts(8, 64, 32, 22, zentorch=False)
        ex.w13.copy_(new.w13)
        ex.w2.copy_(new.w2)
        torch.ops.zentorch.zentorch_clear_weight_cache()
        stale = ex.forward_topk(x, ids, weights)
        zen.flush_cache()
        fresh = ex.forward_topk(x, ids, weights)
    if torch.equal(stale, before):  # documents zentorch 2.13's behaviour; a fixed zentorch may drop this
        assert not torch.equal(fresh, before)
    _assert_close(fresh, _reference(ex, x, ids, weights))


def test_new_experts_where_freed_ones_were_use_their_own_weights():
    """Engines built and dropped one after another reuse freed memory: every new set of experts must compute
    with its own weights, never the reordered copy of whatever was there before."""
    x, ids, weights = _routing(32, 2, 8, 64, 8)
    for seed in range(6):
        ex = _experts(8, 64, 32, 100 + seed, scale=0.05 * (seed + 1))
        with torch.no_grad():
            y = ex.forward_topk(x, ids, weights)
        _assert_close(y, _reference(ex, x, ids, weights))
        del ex
        gc.collect()


def test_one_opaque_op_in_a_full_graph():
    ex = _experts(8, 64, 32, 9)
    x, ids, weights = _routing(4, 2, 8, 64, 10)
    rows, row_ids, row_w = x.repeat_interleave(2, 0), ids.reshape(-1).clone(), weights.reshape(-1)
    row_ids[3] = -1
    with torch.no_grad():
        topk = torch.compile(lambda a, b, c: ex.forward_topk(a, b, c), fullgraph=True, dynamic=False)
        assert torch.equal(topk(x, ids, weights), ex.forward_topk(x, ids, weights))
        by_row = torch.compile(lambda a, b, c: ex(a, b, c), fullgraph=True, dynamic=False)
        assert torch.equal(by_row(rows, row_ids, row_w), ex(rows, row_ids, row_w))


def test_switched_off_keeps_the_per_expert_path():
    ex = _experts(4, 64, 32, 11, zentorch=False)
    assert not ex.fused
    x, ids, weights = _routing(3, 2, 4, 64, 14)
    with torch.no_grad():
        assert torch.equal(ex.forward_topk(x, ids, weights), _reference(ex, x, ids, weights))
    ex.process_weights_after_loading()
    assert ex.fused and ex.packed is None


def test_bf16_a8w8_engine_compiled_gives_eager_tokens_through_zentorch(ckpt_dir, monkeypatch):
    """A BF16 A8W8 engine: every routed layer on zentorch's INT8 fused MoE, and the compiled decode graphs (the
    experts inside the moe_routed opaque op) give the eager path's greedy tokens."""
    from tests.engine.test_compiled_decode import assert_graphs_ran, eager_and_compiled
    monkeypatch.delenv("MOESERVE_ENFORCE_EAGER", raising=False)  # tests/conftest.py makes engines eager
    want, got, llm = eager_and_compiled(ckpt_dir("v3"), dtype="bfloat16", quantization="a8w8")
    assert got == want
    assert_graphs_ran(llm, [1, 2, 4, 8])
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8FusedExperts)]
    assert experts and all(ex.fused and ex.act_dtype == torch.bfloat16 for ex in experts)
    linears = [m for m in llm.engine.runner.model.modules() if hasattr(m, "weight_scale_vector")]
    assert linears and all(m.weight_zen is not None for m in linears)  # the A8W8 Linears (lm_head too)


def _exact_int8(layer, x):
    """The same A8W8 Linear without zentorch: per-token quantization, INT32 GEMM, float32 epilogue."""
    from moeserve.layers.quant import int8_linear
    return int8_linear(x, layer.weight, layer.weight_scale, layer.bias, None)


@pytest.mark.parametrize("n,k", [(384, 1024), (3072, 384), (100, 72), (7, 5)])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_int8_linear_on_zentorch_matches_the_exact_path(n, k, rows):
    """A BF16 model's A8W8 Linear runs zentorch's dynamic-quantization INT8 linear: the same arithmetic (per-token
    symmetric INT8 activations, INT32 accumulation, per-channel weight scales): most outputs are bit-equal, the
    rest differ where an activation's quantized value rounds the other way (measured up to ~0.8% of the
    output's scale; a wrong weight differs by ~100%)."""
    layer = int8_linear_layer(n, k, seed=n + k, bias=(n == 100))
    assert layer.weight_zen is not None and layer.weight_packed is None
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()  # [..., K] inputs
    with torch.no_grad():
        y, ref = layer(x), _exact_int8(layer, x)
    assert y.shape == (2, rows, n) and y.dtype == torch.bfloat16
    _assert_close(y, ref)


def test_int8_linear_on_zentorch_only_for_bf16_models_and_when_switched_on(monkeypatch):
    """A float32 model keeps the oneDNN / exact path (zentorch's INT8 linear takes BF16 activations);
    MOESERVE_ZENTORCH_INT8=0 switches it off with the INT8 experts; float32 inputs to a BF16 model's layer
    take the exact path."""
    fp32 = int8_linear_layer(256, 1024, 1, dtype=torch.float32)
    assert fp32.weight_zen is None
    layer = int8_linear_layer(256, 1024, 1)
    x = torch.randn(4, 1024)
    with torch.no_grad():
        assert torch.equal(layer(x), _exact_int8(layer, x))
    monkeypatch.setenv("MOESERVE_ZENTORCH_INT8", "0")
    off = int8_linear_layer(256, 1024, 1)
    assert off.weight_zen is None


def test_int8_linear_new_weights_at_the_same_address_use_their_own():
    """No address-keyed cache behind the packed INT8 linear (unlike the experts' kernel): a layer that ran once,
    then had another layer's pack written over its own storage (new weights at the same address, what a freed
    and reused address gives), computes with the new weights."""
    x = torch.randn(2, 512).bfloat16()
    layer, other = int8_linear_layer(512, 512, seed=100), int8_linear_layer(512, 512, seed=101)
    with torch.no_grad():
        _assert_close(layer(x), _exact_int8(layer, x))
        address = layer.weight_zen.data_ptr()
        layer.weight_zen.untyped_storage().copy_(other.weight_zen.untyped_storage())  # compensation included
        layer.weight_scale_vector.copy_(other.weight_scale_vector)
        layer.weight.copy_(other.weight)
        layer.weight_scale.copy_(other.weight_scale)
        assert layer.weight_zen.data_ptr() == address
        _assert_close(layer(x), _exact_int8(other, x))


def test_int8_linear_is_one_opaque_op_in_a_full_graph_and_its_pack_is_counted():
    layer = int8_linear_layer(384, 1024, 3)
    x = torch.randn(4, 1024).bfloat16()
    with torch.no_grad():
        compiled = torch.compile(lambda a: layer(a), fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), layer(x))
    # the pack's storage: the INT8 weight plus zentorch's per-channel compensation (int32 per output channel)
    assert packed_copy_bytes(layer) == 384 * 1024 + 384 * 4
