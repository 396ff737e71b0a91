"""Linear layers. Kept as our own module so quantized and tensor-parallel variants swap in by name."""
import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b), weight stored [out_features, in_features] as in the checkpoint.

    A quantization method (layers/quant.py) may take over the weights: it then owns their layout, loading
    (load_tensor) and the matmul (apply); the float path below is the unquantized case.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.quant_method = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight [out, in] in the model dtype, whatever its storage (e.g. MLA's absorbed matrices)."""
        if self.quant_method is not None:
            return self.quant_method.dequantized_weight(self)
        return self.weight.detach()

    def extra_repr(self) -> str:
        q = "" if self.quant_method is None else f", quant={self.quant_method.__name__}"
        return f"in={self.in_features}, out={self.out_features}{q}"
