"""BF16 weights packed once for oneDNN (layers/linear.py): the same results as F.linear, counted in memory."""
import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.linear import Linear, pack_weight, packed_copy_bytes, packed_linear


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_packed_linear_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    if packed is None:
        pytest.skip("oneDNN BF16 packing does not run here")
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    assert torch.equal(packed_linear(x, packed), F.linear(x, w))
    assert torch.equal(packed_linear(x, packed, bias), F.linear(x, w, bias))
    assert packed_linear(x.view(1, rows, 80), packed).shape == (1, rows, 96)


def test_only_bf16_cpu_weights_are_packed_and_the_copies_are_counted(monkeypatch):
    from moeserve.layers import onednn_linear
    from moeserve.layers.moe import zen

    # PyTorch's oneDNN packing, also where zentorch or vLLM's library (layers/onednn_linear.py) would take it
    monkeypatch.setattr(zen, "available", lambda: False)
    monkeypatch.setattr(onednn_linear, "available", lambda: False)
    assert pack_weight(torch.randn(8, 8)) is None  # float32 stays as it is
    layer = Linear(80, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 80))
    layer.process_weights_after_loading()
    if layer.weight_packed is None:
        pytest.skip("oneDNN BF16 packing does not run here")
    assert packed_copy_bytes(layer) >= 96 * 80 * 2
    with torch.no_grad():
        x = torch.randn(3, 80).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_zentorch_prepacked_linear_equals_f_linear_in_and_out_of_graphs(rows):
    """AMD CPUs with zentorch: BF16 Linears run zentorch's linear on a prepacked copy of their own."""
    from moeserve.layers.moe import zen

    if not zen.available():
        pytest.skip("zentorch is not available here")
    g = torch.Generator().manual_seed(rows)
    layer = Linear(80, 96, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 80, generator=g))
        layer.bias.copy_(torch.randn(96, generator=g))
    layer.process_weights_after_loading()
    assert layer.weight_zen is not None and layer.weight_packed is None
    assert packed_copy_bytes(layer) >= 96 * 80 * 2
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        got = layer(x)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=5e-2)
        compiled = torch.compile(lambda t: layer(t), fullgraph=True, dynamic=False)(x)
        assert torch.equal(compiled, got)
        assert layer(x.view(1, rows, 80)).shape == (1, rows, 96)
