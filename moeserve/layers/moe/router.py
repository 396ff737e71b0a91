"""Top-k expert routers of the DeepSeek family, in float32.

- V2: softmax scores; topk_method greedy or group_limited_greedy (groups ranked by their best expert).
- V3: sigmoid scores plus e_score_correction_bias for choosing only (aux-loss-free balancing);
  noaux_tc ranks groups by the sum of their two best biased scores. Weights come from the unbiased scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.arch import DeepseekArch


class Router(nn.Module):
    def __init__(self, arch: DeepseekArch) -> None:
        super().__init__()
        self.num_experts = arch.n_routed_experts
        self.top_k = arch.num_experts_per_tok
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.scoring, self.method = arch.scoring_func, arch.topk_method
        self.scaling = arch.routed_scaling_factor
        # As transformers: DeepseekV3 renormalises whenever norm_topk_prob is set, even for top-1 (the weight
        # becomes 1); for V2 only more than one expert is renormalised (DeepSeek's V2 code; transformers' V2
        # never renormalises, so the two agree at top-1).
        v3 = arch.architecture == "DeepseekV3ForCausalLM"
        self.renormalize = arch.norm_topk_prob and (v3 or self.top_k > 1)
        self.weight = nn.Parameter(torch.empty(self.num_experts, arch.hidden_size, dtype=torch.float32))
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        logits = F.linear(x.float(), self.weight)  # [T, E]
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            group_scores = self._grouped(choice).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        elif self.method == "group_limited_greedy":
            group_scores = self._grouped(scores).max(dim=-1).values
            weights, ids = self._mask_groups(scores, group_scores, 0.0).topk(self.top_k, dim=-1, sorted=False)
        else:
            weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _grouped(self, s: torch.Tensor) -> torch.Tensor:
        return s.view(s.shape[0], self.n_group, self.num_experts // self.n_group)  # [T, G, E/G]

    def _mask_groups(self, s: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        keep_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand(-1, -1, self.num_experts // self.n_group)
        return s.masked_fill(~expert_mask.reshape(s.shape[0], self.num_experts), fill)  # explicit: T may be 0
