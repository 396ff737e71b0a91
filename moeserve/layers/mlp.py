import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.linear import Linear


class DenseMLP(nn.Module):
    """SwiGLU MLP with the checkpoint's gate_proj / up_proj / down_proj names."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
