"""The grouped expert path (torch._grouped_mm over exactly each expert's rows) against a per-expert loop,
and the oneDNN-packed INT8 GEMM against an exact integer reference."""
import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.linear import packed_copy_bytes
from moeserve.layers.moe.experts import FusedExperts, group_rows
from moeserve.layers.quant import Int8FusedExperts, Int8Packed, int8_linear, quantize_per_channel


def _loop_reference(ex: FusedExperts, x, ids, weights):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        e = int(ids[r])
        if e < 0:
            continue
        gate, up = (x[r].double() @ ex.w13[e].double().t()).split(ex.intermediate)
        out[r] = (F.silu(gate) * up) @ ex.w2[e].double().t() * weights[r].double()
    return out


@pytest.mark.parametrize("n", [1, 6, 48, 300])
def test_grouped_experts_match_per_expert_loop(n):
    g = torch.Generator().manual_seed(n)
    ex = FusedExperts(8, 64, 32)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.1)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.1)
    x = torch.randn(n, 64, generator=g)
    ids = torch.randint(-1, 8, (n,), generator=g)
    ids[0] = 3
    weights = torch.rand(n, generator=g)
    with torch.no_grad():
        y = ex(x, ids, weights)
    torch.testing.assert_close(y.double(), _loop_reference(ex, x, ids, weights), rtol=1e-4, atol=1e-5)
    assert (y[ids == -1] == 0).all()


def test_grouped_experts_bf16_rows_past_every_group_are_zero():
    ex = FusedExperts(4, 32, 16).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.normal_()
        ex.w2.normal_()
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    ids = torch.tensor([-1, 2, -1, 2, 0])
    with torch.no_grad():
        y = ex(x, ids, torch.ones(5))
        assert (y[[0, 2]] == 0).all() and torch.isfinite(y).all()
        assert ex(x, torch.full((5,), -1), torch.ones(5)).abs().sum() == 0


def test_group_rows_offsets():
    order, offs, valid = group_rows(torch.tensor([2, -1, 0, 2, 2]), 3)
    assert offs.tolist() == [1, 1, 4] and offs.dtype == torch.int32
    assert order[:4].tolist() == [2, 0, 3, 4] and valid.tolist() == [True] * 4 + [False]


@pytest.fixture
def pack_anywhere(monkeypatch):
    """The packed oneDNN path is used only on CPUs with VNNI or AMX (elsewhere oneDNN runs it on a slow
    reference kernel), but it is exact everywhere: test it on any CPU."""
    from moeserve.layers import quant

    monkeypatch.setattr(quant, "_INT8_UNIT", "amx")  # packs every weight, runs it packed at every row count


@pytest.mark.parametrize("m", [0, 1, 5, 64, 257])
def test_packed_int8_gemm_exact(m, pack_anywhere):
    packed_ok = Int8Packed.of(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1))
    if packed_ok is None:
        pytest.skip("oneDNN does not run here")
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-127, 128, (m, 96), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=g)
    scale = torch.rand(40, 1, generator=g) * 0.01
    exact = (a.long() @ w.long().t())  # int64: the exact sums
    got = Int8Packed.of(w, scale).mm_scaled(a)
    assert got.dtype == torch.float32 and got.shape == (m, 40)
    assert torch.equal(got, exact.to(torch.int32).float() * scale.view(1, -1))


def test_packed_int8_linear_equals_unpacked(pack_anywhere):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 80, generator=g)
    q, s = quantize_per_channel(w)
    packed = Int8Packed.of(q, s)
    if packed is None:
        pytest.skip("oneDNN does not run here")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 80, generator=g).to(dtype)
        assert torch.equal(int8_linear(x, q, s, packed=packed), int8_linear(x, q, s))


def _int8_experts(num: int, g: torch.Generator) -> Int8FusedExperts:
    """num random experts (hidden 64, intermediate 32), quantized at load as a float checkpoint would be."""
    ref = FusedExperts(num, 64, 32)
    with torch.no_grad():
        ref.w13.copy_(torch.randn(ref.w13.shape, generator=g) * 0.1)
        ref.w2.copy_(torch.randn(ref.w2.shape, generator=g) * 0.1)
    q = Int8FusedExperts.like(ref)
    for slot in range(num):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q.load_expert(slot, proj, "weight", ref.expert_weight(slot, proj), f"e{slot}.{proj}")
    return q


def test_int8_experts_packed_equal_unpacked(pack_anywhere):
    g = torch.Generator().manual_seed(4)
    q = _int8_experts(6, g)
    x = torch.randn(30, 64, generator=g)
    ids = torch.randint(-1, 6, (30,), generator=g)
    w = torch.rand(30, generator=g)
    with torch.no_grad():
        plain = q(x, ids, w)
        q.process_weights_after_loading()
        if q.packed is None:
            pytest.skip("oneDNN does not run here")
        assert torch.equal(q(x, ids, w), plain)


@pytest.mark.parametrize("t", [1, 7, 80])
def test_int8_forward_topk_equals_rows_through_forward(t, pack_anywhere):
    """forward_topk quantizes each token once and gathers it per expert (no repeated tokens), packed or not,
    with the row path's bits; 80 tokens take the compiled quantizer where an engine switched it on."""
    g = torch.Generator().manual_seed(300 + t)
    q = _int8_experts(6, g)
    x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    with torch.no_grad():
        for packed in (False, True):
            if packed:
                q.process_weights_after_loading(fused_kernels=False)
            got = q.forward_topk(x, ids, w)
            rows = q(x.repeat_interleave(2, dim=0), ids.reshape(-1), w.reshape(-1))
            assert torch.equal(got, rows.view(t, 2, 64).sum(dim=1)), packed
            assert torch.equal(got, q.topk_as_rows(x, ids, w)), packed


def test_vnni_packs_large_weights_and_runs_them_packed_from_two_rows(monkeypatch):
    """Without AMX, oneDNN's call overhead pays only for large weights and more than one row: smaller ones
    stay unpacked, a one-row GEMM goes through torch._int_mm, and the mix gives the same result."""
    from moeserve.layers import quant

    monkeypatch.setattr(quant, "_INT8_UNIT", "vnni")
    if Int8Packed.of(torch.zeros(1024, 1024, dtype=torch.int8), torch.ones(1024, 1)) is None:
        pytest.skip("oneDNN does not run here")
    assert Int8Packed.of(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1)) is None  # too small to pay
    monkeypatch.setattr(quant, "_VNNI_PACK_MIN_ELEMENTS", 0)
    packed = Int8Packed.of(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1))
    assert not packed.pays(1) and packed.pays(2)
    g = torch.Generator().manual_seed(5)
    q = _int8_experts(4, g)
    x = torch.randn(7, 64, generator=g)
    ids = torch.tensor([0, 1, 1, 2, 2, 2, -1])  # one row (unpacked), two and three rows (packed), expert 3 idle
    w = torch.rand(7, generator=g)
    # forward_topk's tokens, flipped to uint8 before their gather: expert 0 takes one row (unpacked, from the
    # flipped rows), experts 1 and 2 several (packed)
    topk_ids, topk_w = torch.tensor([[0, 1], [1, 2], [2, 2]]), torch.rand(3, 2, generator=g)
    with torch.no_grad():
        plain, plain_topk = q(x, ids, w), q.forward_topk(x[:3], topk_ids, topk_w)
        q.process_weights_after_loading()
        assert q.packed is not None
        assert torch.equal(q(x, ids, w), plain)
        assert torch.equal(q.forward_topk(x[:3], topk_ids, topk_w), plain_topk)


def _bf16_experts(num: int, hidden: int, inter: int, seed: int) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(num, hidden, inter).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.1)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.1)
    return ex


def _per_expert_f_linear(ex: FusedExperts, x, ids, weights):
    """The packed path's arithmetic, one expert at a time with F.linear on the stacked weights."""
    out = torch.zeros_like(x)
    for e in range(ex.num_local_experts):
        rows = (ids == e).nonzero().squeeze(1)
        if rows.numel():
            gate, up = F.linear(x[rows], ex.w13[e]).split(ex.intermediate, dim=-1)
            y = F.linear(F.silu(gate) * up, ex.w2[e])
            out[rows] = (y.float() * weights[rows, None]).to(x.dtype)
    return out


@pytest.mark.parametrize("n", [1, 9, 40, 300])
def test_packed_bf16_experts_equal_per_expert_linear(n):
    ex = _bf16_experts(8, 64, 32, n)
    g = torch.Generator().manual_seed(100 + n)
    x = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (n,), generator=g)
    ids[ids == 5] = 6  # an expert with no rows
    weights = torch.rand(n, generator=g)
    with torch.no_grad():
        grouped = ex(x, ids, weights)
        ex.process_weights_after_loading(fused_kernels=False)
        if ex.packed is None:
            pytest.skip("oneDNN BF16 packing does not run here")
        packed = ex(x, ids, weights)
    assert torch.equal(packed, _per_expert_f_linear(ex, x, ids, weights))
    torch.testing.assert_close(packed.float(), grouped.float(), rtol=2e-2, atol=2e-3)
    assert (packed[ids == -1] == 0).all()
    assert packed_copy_bytes(ex) >= 8 * 3 * 64 * 32 * 2


@pytest.mark.parametrize("t", [1, 5, 64])
def test_packed_bf16_forward_topk_equals_rows_through_forward(t):
    """forward_topk over the packed copies gathers each token once per expert it routes to (no repeated
    copy of every token first) and gives the bits of the row path: each (token, expert) row's
    per-expert result, weighted, summed over the token's experts. Rows of other ranks (-1) count 0."""
    ex = _bf16_experts(8, 64, 32, t)
    ex.process_weights_after_loading(fused_kernels=False)
    if ex.packed is None:
        pytest.skip("oneDNN BF16 packing does not run here")
    g = torch.Generator().manual_seed(200 + t)
    x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)])
    ids[0, 1] = -1
    weights = torch.rand(t, 3, generator=g)
    with torch.no_grad():
        got = ex.forward_topk(x, ids, weights)
        rows = _per_expert_f_linear(ex, x.repeat_interleave(3, dim=0), ids.reshape(-1), weights.reshape(-1))
        assert torch.equal(got, rows.view(t, 3, 64).sum(dim=1))
        assert torch.equal(got, ex.topk_as_rows(x, ids, weights))


def test_packed_bf16_experts_in_a_compiled_graph_and_switched_off(monkeypatch):
    """Above the few-row gathered path, a fullgraph compile calls the packed experts as one opaque op and gets
    the eager result; MOESERVE_PACK_EXPERTS=0 keeps one copy."""
    ex = _bf16_experts(4, 64, 32, 7)
    ex.process_weights_after_loading(fused_kernels=False)
    if ex.packed is None:
        pytest.skip("oneDNN BF16 packing does not run here")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 4, (12,), generator=g)
    weights = torch.rand(12, generator=g)
    with torch.no_grad():
        compiled = torch.compile(lambda a, b, c: ex(a, b, c), fullgraph=True, dynamic=False)(x, ids, weights)
        assert torch.equal(compiled, ex(x, ids, weights))
    monkeypatch.setenv("MOESERVE_PACK_EXPERTS", "0")
    one_copy = _bf16_experts(4, 64, 32, 7)
    one_copy.process_weights_after_loading(fused_kernels=False)
    assert one_copy.packed is None and packed_copy_bytes(one_copy) == 0


@pytest.mark.parametrize("rows", [0, 1, 6, 48, 300])
def test_grouped_on_host_matches_group_rows(rows, monkeypatch):
    """The host-side grouping of few rows (decode) gives group_rows' order and bounds, rows of other ranks
    (-1) left out; past HOST_GROUP_MAX_ROWS it is group_rows itself."""
    from moeserve.layers.moe import experts

    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(-1, 8, (rows,), generator=g)
    order, offs, _ = group_rows(ids, 8)
    want_bounds = [0] + offs.tolist()
    for limit in (0, 1024):  # tensors, then lists
        monkeypatch.setattr(experts, "HOST_GROUP_MAX_ROWS", limit)
        mine, bounds = experts.grouped_on_host(ids, 8)
        assert bounds == want_bounds and mine.dtype == torch.long
        assert torch.equal(mine, order[: want_bounds[-1]])
