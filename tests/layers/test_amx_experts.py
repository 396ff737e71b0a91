"""Routed experts through vLLM's AMX fused MoE kernels (layers/moe/amx.py), BF16 and A8W8, against the
per-expert paths; their weight copies after loads and moves; inside a compiled graph.

These run where the kernels are available (an Intel CPU with AMX and vLLM's CPU kernels, which
scripts/setup.sh installs there); elsewhere the module is skipped and the experts run on the paths the other
tests cover."""
import pytest
import torch

from moeserve.int8 import quantize_per_channel
from moeserve.layers.linear import packed_copy_bytes
from moeserve.layers.moe import amx
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.quant import Int8FusedExperts

pytestmark = pytest.mark.skipif(not amx.available(), reason="vLLM's AMX fused MoE is not available here")


def _bf16(num: int, hidden: int, inter: int, seed: int, fused: bool = True) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(num, hidden, inter).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.1)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.1)
    ex.process_weights_after_loading(fused_kernels=fused)
    return ex


def _int8(num: int, hidden: int, inter: int, seed: int, fused: bool = True) -> Int8FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = Int8FusedExperts(num, hidden, inter)
    ex.act_dtype = torch.bfloat16
    with torch.no_grad():
        for w, s in ((ex.w13, ex.w13_scale), (ex.w2, ex.w2_scale)):
            q, sc = quantize_per_channel(torch.randn(w.shape, generator=g) * 0.1)
            w.copy_(q)
            s.copy_(sc[..., 0])
    ex.process_weights_after_loading(fused_kernels=fused)
    return ex


def _copy(ex, fused: bool):
    """The same weights in a module of its own, set up with or without the fused kernel."""
    new = type(ex)(ex.num_local_experts, ex.w13.shape[-1], ex.intermediate)
    if isinstance(ex, Int8FusedExperts):
        new.act_dtype = ex.act_dtype
    else:
        new = new.to(ex.w13.dtype)
    new.load_state_dict(ex.state_dict())
    new.process_weights_after_loading(fused_kernels=fused)
    return new


def _reference(ex, x, ids, weights) -> torch.Tensor:
    """float32 over the (dequantized) weights: the sum over k of weight x SwiGLU expert, per token."""
    w13, w2 = ex.dequantized() if isinstance(ex, Int8FusedExperts) else (ex.w13.float(), ex.w2.float())
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t].float()).split(ex.intermediate)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.float() - ref).abs().max().item() / ref.abs().max().item()


def _routing(t: int, k: int, num: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, hidden, generator=g).to(torch.bfloat16), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("make", [_bf16, _int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("t", [1, 6, 33, 300])
def test_fused_kernel_is_as_close_to_float32_as_the_per_expert_path(make, t):
    """The kernels round at other points than the per-expert path (BF16 intermediates, their own per-token
    quantization): no bit equality, so both are held to the float32 reference over the same weights, the kernel
    within 1.5x the per-expert path's error plus half a BF16 step of the output's scale."""
    ex = make(16, 128, 64, t)
    assert ex.fused == "amx" and ex.packed is None and ex.fused_weights is not None
    x, ids, weights = _routing(t, 4, 16, 128, t)
    with torch.no_grad():
        y, base = ex.forward_topk(x, ids, weights), _copy(ex, fused=False).forward_topk(x, ids, weights)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = _reference(ex, x, ids, weights)
    assert _error(y, ref) <= 1.5 * _error(base, ref) + 2 ** -9, (_error(y, ref), _error(base, ref))


@pytest.mark.parametrize("make", [_bf16, _int8], ids=["bf16", "int8"])
def test_rows_of_other_ranks_are_zero_and_the_rest_match(make):
    """The row interface (all-to-all / all-gather dispatch): one expert per row, -1 = another rank's row."""
    ex = make(8, 64, 32, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([0, -1, 3, 7, -1, 2, 2, 5, -1, 1, 6, 4])
    weights = torch.rand(12, generator=g)
    with torch.no_grad():
        y = ex(x, ids, weights)
        one = ex.forward_topk(x[2:3], ids[2:3, None], weights[2:3, None])
        none = ex(x[:0], ids[:0], weights[:0])
    assert torch.equal(y[ids < 0], torch.zeros(3, 64, dtype=torch.bfloat16))
    assert torch.equal(y[2], one[0])  # the same kernel call for the row alone
    assert none.shape == (0, 64)


@pytest.mark.parametrize("make", [_bf16, _int8], ids=["bf16", "int8"])
def test_new_weights_are_used_after_a_reload(make):
    """An EPLB move or a reload writes the stacked weights, then process_weights_after_loading: the kernel's
    copies are remade from them (no cache keyed by address can hand back the old ones)."""
    ex, other = make(8, 64, 32, 5), make(8, 64, 32, 6)
    x, ids, weights = _routing(4, 2, 8, 64, 7)
    with torch.no_grad():
        before = ex.forward_topk(x, ids, weights)
        ex.load_state_dict(other.state_dict())
        ex.process_weights_after_loading()
        after = ex.forward_topk(x, ids, weights)
    assert torch.equal(after, other.forward_topk(x, ids, weights)) and not torch.equal(after, before)


def test_copies_are_counted_for_the_kv_sizing():
    bf16, int8 = _bf16(8, 64, 32, 1), _int8(8, 64, 32, 1)
    assert packed_copy_bytes(bf16) == bf16.w13.nbytes + bf16.w2.nbytes  # the same shapes, reordered
    # INT8 rows carry a 4-byte compensation term each: [E, N, K + 4]
    assert packed_copy_bytes(int8) == int8.w13.nbytes + int8.w2.nbytes + 4 * 8 * (64 + 64)


def test_shapes_off_the_kernels_tiles_and_float32_keep_the_per_expert_paths():
    assert _bf16(8, 48, 32, 1).fused == ""  # hidden 48 is not a multiple of 32
    assert _bf16(8, 64, 16, 1).fused == ""
    float32 = FusedExperts(4, 64, 32)
    float32.process_weights_after_loading()
    assert float32.fused == ""
    float32_int8 = _int8(4, 64, 32, 1)
    float32_int8.act_dtype = torch.float32
    float32_int8.process_weights_after_loading()
    assert float32_int8.fused == ""


@pytest.mark.parametrize("make", [_bf16, _int8], ids=["bf16", "int8"])
def test_a_compiled_graph_calls_the_kernel_as_one_op_with_the_eager_bits(make):
    ex = make(8, 64, 32, 9)
    x, ids, weights = _routing(3, 2, 8, 64, 10)

    def block(x, ids, weights):
        return ex.forward_topk(x * 1.0, ids, weights) + 1.0

    torch._dynamo.reset()
    with torch.no_grad():
        eager = block(x, ids, weights)
        compiled = torch.compile(block, fullgraph=True, dynamic=False)(x, ids, weights)
    assert torch.equal(compiled, eager)
