"""The routed experts' passes around their GEMMs as inductor kernels (layers/moe/expert_epilogue.py): the bits
of the eager code they replace, alone and inside forward_topk of the BF16 (packed) and INT8 experts."""
import pytest
import torch
import torch.nn.functional as F

from moeserve.int8 import quantize_per_token
from moeserve.layers.moe import expert_epilogue
from moeserve.layers.moe.experts import FusedExperts, _times_weights, group_rows
from moeserve.layers.quant import Int8FusedExperts


@pytest.fixture
def epilogue_on(monkeypatch):
    """Kernels on for this test only (enable() is process-wide, as an engine that compiles leaves it)."""
    expert_epilogue.enable()
    compiled = expert_epilogue._combine, expert_epilogue._swiglu_quant
    yield compiled
    monkeypatch.setattr(expert_epilogue, "_combine", compiled[0])


def _pairs(tokens: int, k: int, experts: int, holes: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens * k,), generator=g)
    if holes:  # pairs routed to another rank
        ids[::5] = -1
    order, offs, _ = group_rows(ids, experts)
    return order[: int(offs[-1])], torch.rand(tokens * k, generator=g), g


@pytest.mark.parametrize("tokens,k,holes", [(100, 6, False), (333, 8, True)])
@pytest.mark.parametrize("y_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float32)])
def test_combine_has_the_bits_of_scatter_then_sum(epilogue_on, tokens, k, holes, y_dtype, out_dtype):
    mine, w, g = _pairs(tokens, k, 64, holes, tokens + k)
    y = (torch.randn(mine.numel(), 96, generator=g) * 40).to(y_dtype)
    scale = w[mine]
    out = torch.zeros(tokens * k, 96, dtype=out_dtype)
    out[mine] = (y.float() * scale[:, None]).to(out_dtype)
    want = out.view(tokens, k, 96).sum(dim=1)
    got = expert_epilogue.combine(y, scale, mine, tokens, k, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)


@pytest.mark.parametrize("rows,inter", [(64, 256), (2131, 256), (700, 1408), (97, 2048)])
def test_swiglu_quant_has_the_bits_of_the_eager_passes(epilogue_on, rows, inter):
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * inter, generator=g) * 3000  # INT32 sums, float32, before the activation scale
    xs = torch.rand(rows, 1, generator=g) * 0.01
    gate, up = (h.clone() * xs).split(inter, dim=-1)
    want_q, want_s = quantize_per_token(F.silu(gate) * up)
    got_q, got_s = expert_epilogue.swiglu_quant(h, xs, inter)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    assert expert_epilogue.swiglu_quant_for(rows, inter)


def test_swiglu_quant_left_to_the_eager_passes_where_rows_are_not_whole_vector_steps(epilogue_on):
    assert not expert_epilogue.swiglu_quant_for(1000, 48)  # ATen's scalar tail: other bits now and then
    assert not expert_epilogue.swiglu_quant_for(expert_epilogue.MIN_ROWS - 1, 256)  # decode-sized


def _bf16_experts(g: torch.Generator) -> FusedExperts:
    ex = FusedExperts(16, 64, 32).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.1)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.1)
    return ex


def _int8_experts(g: torch.Generator) -> Int8FusedExperts:
    ref = FusedExperts(16, 64, 32).to(torch.bfloat16)
    with torch.no_grad():
        ref.w13.copy_(torch.randn(ref.w13.shape, generator=g) * 0.1)
        ref.w2.copy_(torch.randn(ref.w2.shape, generator=g) * 0.1)
    q = Int8FusedExperts.like(ref)
    for slot in range(16):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q.load_expert(slot, proj, "weight", ref.expert_weight(slot, proj).float(), f"e{slot}.{proj}")
    return q


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("tokens", [5, 200])  # decode-sized (eager passes either way), prefill-sized
def test_forward_topk_same_bits_with_the_kernels(epilogue_on, monkeypatch, kind, tokens):
    g = torch.Generator().manual_seed(7 + tokens)
    ex = _bf16_experts(g) if kind == "bf16" else _int8_experts(g)
    ex.process_weights_after_loading(fused_kernels=False)
    if ex.packed is None:
        pytest.skip("oneDNN packing does not run here")
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, generator=g)
    calls = []
    monkeypatch.setattr(expert_epilogue, "_combine", lambda *a: calls.append(1) or epilogue_on[0](*a))
    with torch.no_grad():
        fused = ex.forward_topk(x, ids, weights)
        monkeypatch.setattr(expert_epilogue, "_combine", None)  # the eager passes
        eager = ex.forward_topk(x, ids, weights)
    assert bool(calls) == (tokens * 4 >= expert_epilogue.MIN_ROWS)
    assert torch.equal(fused, eager)
    if kind == "bf16":  # and the rows path through forward(): weighted rows, summed per token
        rows = ex(x.repeat_interleave(4, dim=0), ids.reshape(-1), weights.reshape(-1))
        assert torch.equal(fused, rows.view(tokens, 4, 64).sum(dim=1))


def test_times_weights_is_what_combine_weights_with():
    """combine weights as (y.float() * w).to(dtype); the eager path's blocked _times_weights must agree."""
    y = torch.randn(300, 64).to(torch.bfloat16)
    w = torch.rand(300)
    assert torch.equal(_times_weights(y.clone(), w, block=128), (y.float() * w[:, None]).to(torch.bfloat16))
