"""Builders the INT8 tests share."""
import torch


def int8_linear_layer(n: int, k: int, seed: int, dtype=torch.bfloat16, bias: bool = False):
    """An A8W8 Linear [n x k] of a `dtype` model, filled from random float weights and packed as at load (so on
    the INT8 kernel the machine has: zentorch's, the AMX one, or oneDNN's)."""
    from moeserve.layers.linear import Linear
    from moeserve.layers.quant import Int8LinearMethod

    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias).to(dtype)
    Int8LinearMethod.create_weights(layer)
    Int8LinearMethod.load_tensor(layer, "weight", torch.randn(n, k, generator=g) * 0.05, "w")
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(n, generator=g).to(dtype))
    layer.process_weights_after_loading()
    return layer
