"""A BF16 model's A8W8 Linears through vLLM's INT8 GEMM (layers/amx_linear.py) against the exact INT8 path.

These run where the kernel is available (vLLM's CPU kernels, which scripts/setup.sh installs on x86 CPUs with
AVX-512 BF16: AMX tiles on Intel CPUs with AMX, VNNI on AMD Zen 4); elsewhere skipped, and the Linears run the
oneDNN / exact paths the other tests cover. On AMD CPUs with zentorch its INT8 linear also takes the layers
(above amx_linear.SMALL_ROWS rows): switched off here but for the test of that split."""
import pytest
import torch

from moeserve.layers import amx_linear
from moeserve.layers.linear import Linear, packed_copy_bytes
from moeserve.layers.moe import zen
from moeserve.layers.quant import int8_linear
from tests.quant.helpers import int8_linear_layer

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="vLLM's INT8 GEMM is not available here")


ZEN_INT8_LINEAR = zen.usable_int8_linear


@pytest.fixture(autouse=True)
def _library_alone(monkeypatch):
    monkeypatch.setattr(zen, "usable_int8_linear", lambda weight: False)


def _exact(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """The same A8W8 Linear on the exact path: per-token quantization, INT32 GEMM, float32 epilogue."""
    return int8_linear(x, layer.weight, layer.weight_scale, layer.bias, None)


@pytest.mark.parametrize("n,k,bias", [(384, 1024, False), (3072, 384, False), (96, 64, True)])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_matches_the_exact_int8_path(n, k, bias, rows):
    """The same arithmetic (per-token INT8 activations, INT32 accumulation, per-channel weight scales), with the
    kernel's own rounding of each activation's scale: held to 1% of the output's scale (a wrong weight or scale
    is off by ~100%), and most outputs bit-equal."""
    layer = int8_linear_layer(n, k, seed=n + k + rows, bias=bias)
    assert layer.weight_amx is not None and layer.weight_packed is None
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    with torch.no_grad():
        y, ref = layer(x), _exact(layer, x)
    assert y.shape == (2, rows, n) and y.dtype == torch.bfloat16
    diff = (y.float() - ref.float()).abs()
    assert diff.max().item() <= 0.01 * ref.float().abs().max().item(), diff.max().item()
    assert (diff == 0).float().mean().item() > 0.5


def test_only_for_bf16_models_aligned_shapes_and_when_switched_on(monkeypatch):
    float32 = int8_linear_layer(256, 1024, 1, dtype=torch.float32)
    assert float32.weight_amx is None  # a float32 model: the oneDNN path
    assert int8_linear_layer(112, 1024, 1).weight_amx is None  # 112 output channels: not a multiple of 32
    assert int8_linear_layer(256, 48, 1).weight_amx is None  # 48 inputs: not a multiple of 32
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    assert int8_linear_layer(256, 1024, 1).weight_amx is None
    layer = int8_linear_layer(256, 1024, 2)
    x = torch.randn(4, 1024)  # float32 rows into a BF16 model's layer: the exact path
    with torch.no_grad():
        assert torch.equal(layer(x), _exact(layer, x))


def test_one_opaque_op_in_a_full_graph_with_the_eager_bits_and_its_copy_counted():
    layer = int8_linear_layer(384, 1024, 3)
    x = torch.randn(4, 1024).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(lambda a: layer(a * 1.0) + 1.0, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), layer(x) + 1.0)
    assert packed_copy_bytes(layer) == 384 * (1024 + 4)  # INT8 rows plus a 4-byte compensation term each


@pytest.mark.skipif(not zen.available(), reason="zentorch (AMD CPUs) is not available here")
def test_with_zentorch_few_rows_take_the_library_and_more_take_zentorch(monkeypatch):
    """Where both kernels run, a layer keeps both copies (both counted) and picks by row count."""
    monkeypatch.setattr(zen, "usable_int8_linear", ZEN_INT8_LINEAR)
    layer = int8_linear_layer(256, 1024, 4)
    assert layer.weight_amx is not None and layer.weight_zen is not None
    assert packed_copy_bytes(layer) == 2 * 256 * (1024 + 4)  # each: INT8 rows and a 4-byte compensation term
    calls = []
    real_library, real_zen = amx_linear._mm, zen.int8_linear
    monkeypatch.setattr(amx_linear, "_mm", lambda *a: (calls.append("library"), real_library(*a))[1])
    monkeypatch.setattr(zen, "int8_linear", lambda *a: (calls.append("zentorch"), real_zen(*a))[1])
    with torch.no_grad():
        for rows in (1, amx_linear.SMALL_ROWS, amx_linear.SMALL_ROWS + 1, 64):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
            y, ref = layer(x), _exact(layer, x)
            assert (y.float() - ref.float()).abs().max().item() <= 0.01 * ref.float().abs().max().item()
    assert calls == ["library", "library", "zentorch", "zentorch"]


def test_no_rows_give_an_empty_output():
    """An empty input (a rank with no tokens) never reaches the library's kernel, which kills the process with
    a floating-point exception on zero rows."""
    layer = int8_linear_layer(256, 1024, 5)
    with torch.no_grad():
        y = layer(torch.zeros(0, 1024).bfloat16())
    assert y.shape == (0, 256)
