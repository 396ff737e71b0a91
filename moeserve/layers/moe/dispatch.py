"""Dispatch/combine: how token rows reach the experts that hold them and come back.

A dispatcher takes the router's choice for this rank's tokens and returns the weighted sum of their expert
outputs. LocalDispatcher is the single-process case (every expert is here); the distributed dispatchers
(all-to-all, allgather/reduce-scatter) implement the same call.
"""
from __future__ import annotations

import torch

from moeserve.layers.moe.experts import FusedExperts


class LocalDispatcher:
    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 experts: FusedExperts) -> torch.Tensor:
        """x [T, H]; weights, expert_ids [T, k] -> [T, H]."""
        t, k = expert_ids.shape
        rows = x.repeat_interleave(k, dim=0)  # [T*k, H], row t*k+j is token t for its j-th expert
        out = experts(rows, expert_ids.reshape(-1), weights.reshape(-1))
        return out.view(t, k, -1).sum(dim=1)
