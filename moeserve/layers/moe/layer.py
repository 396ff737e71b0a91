"""One MoE block: Router -> Dispatch -> Experts -> Combine, plus the shared experts."""
from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.mlp import DenseMLP
from moeserve.layers.moe.dispatch import LocalDispatcher
from moeserve.layers.moe.experts import FusedExperts
from moeserve.layers.moe.router import Router
from moeserve.models.config import DeepseekArch


class MoE(nn.Module):
    def __init__(self, arch: DeepseekArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(arch)
        self.experts = FusedExperts(arch.n_routed_experts, arch.hidden_size, arch.moe_intermediate_size)
        self.shared_experts = (DenseMLP(arch.hidden_size, arch.moe_intermediate_size * arch.n_shared_experts)
                               if arch.n_shared_experts else None)
        self.dispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.dispatcher(x, weights, expert_ids, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
