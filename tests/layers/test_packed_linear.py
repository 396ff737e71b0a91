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


def test_only_bf16_cpu_weights_are_packed_and_the_copies_are_counted():
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
