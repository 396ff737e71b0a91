"""BF16 Linears through the oneDNN matmul of vLLM's CPU kernel library (layers/onednn_linear.py).

These run where the library is installed (scripts/setup.sh installs it on x86 CPUs with AVX-512 BF16); elsewhere
skipped, and the Linears keep PyTorch's packed path the other tests cover. On AMD CPUs zentorch's linear comes
first (layers/linear.py), so it is switched off here."""
import gc

import pytest
import torch
import torch.nn.functional as F

from moeserve.layers import onednn_linear
from moeserve.layers.linear import Linear, packed_copy_bytes
from moeserve.layers.moe import zen

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="vLLM's CPU kernel library is not available")


@pytest.fixture(autouse=True)
def _library_before_zentorch(monkeypatch):
    monkeypatch.setattr(zen, "available", lambda: False)


def _layer(n: int, k: int, dtype=torch.bfloat16, bias: bool = False, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).to(dtype), requires_grad=False)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype), requires_grad=False)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("n,k,bias", [(384, 1024, False), (3072, 384, False), (100, 72, True)])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_same_bits_as_f_linear(n, k, bias, rows):
    """F.linear's results bit for bit, at decode and prefill row counts, odd shapes and a bias included."""
    layer = _layer(n, k, bias=bias, seed=rows)
    assert layer.weight_onednn is not None and layer.weight_packed is None
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows + 1)).bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (2, rows, n) and y.dtype == torch.bfloat16
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_reads_its_own_copy_and_the_handler_is_released_with_the_layer(monkeypatch):
    """The handler packs its own copy at load (a later change of the parameter is not seen until the next
    load), counted for the KV sizing; dropping the layer releases the handler."""
    layer = _layer(256, 512, seed=3)
    x = torch.randn(4, 512).bfloat16()
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)
        assert torch.equal(layer(x), before)
        layer.process_weights_after_loading()
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert packed_copy_bytes(layer) == 256 * 512 * 2
    released = []
    real = torch.ops._C.release_dnnl_matmul_handler
    monkeypatch.setattr(onednn_linear, "_release", lambda address: (released.append(address), real(address)))
    handle = onednn_linear.handler(layer.weight)
    address = int(handle)
    del handle
    gc.collect()
    assert released == [address]


def test_float32_weights_and_the_switch_keep_pytorchs_packed_path(monkeypatch):
    assert _layer(256, 512, dtype=torch.float32).weight_onednn is None
    monkeypatch.setattr(onednn_linear, "available", lambda: False)
    layer = _layer(256, 512)
    assert layer.weight_onednn is None and layer.weight_packed is not None


def test_one_opaque_op_in_a_full_graph_with_the_eager_bits():
    layer = _layer(384, 1024, seed=5)
    x = torch.randn(4, 1024).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(lambda a: layer(a * 1.0) + 1.0, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), layer(x) + 1.0)
