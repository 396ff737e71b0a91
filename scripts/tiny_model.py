"""The tiny DeepSeek-V3 training module used by train_tiny.py (MLA, dense/MoE blocks with the aux-loss-free
sigmoid router, one MTP layer). Kept apart from the training loop; exported weights are what transformers'
DeepseekV3ForCausalLM computes (train_tiny.check_hf_parity)."""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # same as DeepseekV3RMSNorm
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(cfg: dict, T: int, offset: int = 0):
    d = cfg["qk_rope_head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = (torch.arange(T, dtype=torch.float) + offset)[:, None] * inv  # [T, d/2]
    return freqs.cos(), freqs.sin()


def apply_rope_interleave(x, cos, sin):  # x [B, H, T, d]; same as HF apply_rotary_pos_emb_interleave
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLA(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D, H = c["hidden_size"], c["num_attention_heads"]
        self.H, self.nope, self.rope, self.vd, self.kvr = H, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        self.q_a_proj = nn.Linear(D, c["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"])
        self.q_b_proj = nn.Linear(c["q_lora_rank"], H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kvr + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kvr)
        self.kv_b_proj = nn.Linear(self.kvr, H * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(H * self.vd, D, bias=False)
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x, cos, sin):  # x [B, T, D]
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.H, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.kvr, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_nope)).view(B, T, self.H, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)  # [B, H, T, *]
        k_rot = k_rot.view(B, 1, T, self.rope)
        q_rot = apply_rope_interleave(q_rot, cos, sin)
        k_rot = apply_rope_interleave(k_rot, cos, sin).expand(B, self.H, T, self.rope)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        if v.shape[-1] < q.shape[-1]:  # pad V to the QK head dim so SDPA can use its fused (flash) CPU kernel
            v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)[..., : self.vd]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.H * self.vd))


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Shared expert + routed experts with DeepSeek-V3's noaux_tc sigmoid router (same math as HF)."""

    def __init__(self, c: dict):
        super().__init__()
        D, I, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        self.E, self.k, self.I = E, c["num_experts_per_tok"], I
        self.n_group, self.topk_group = c["n_group"], c["topk_group"]
        self.rsf, self.norm_topk = c["routed_scaling_factor"], c["norm_topk_prob"]
        std = c["initializer_range"]
        self.gate_weight = nn.Parameter(torch.randn(E, D) * std)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * I, D) * std)  # [E, 2I, D]: gate rows then up rows
        self.w_down = nn.Parameter(torch.randn(E, D, I) * std)  # [E, D, I]
        self.shared_experts = MLP(D, I * c["n_shared_experts"])
        self.last_load = None  # [E] routed-token counts of the last forward

    def route(self, x):  # x [N, D]
        with torch.autocast("cpu", enabled=False):
            scores = F.linear(x.float(), self.gate_weight.float()).sigmoid()  # [N, E]
        choice = scores.detach() + self.e_score_correction_bias
        N = x.shape[0]
        g = choice.view(N, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)  # [N, n_group]
        gidx = g.topk(self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(g).scatter_(1, gidx, 1.0)
        smask = gmask.unsqueeze(-1).expand(N, self.n_group, self.E // self.n_group).reshape(N, self.E)
        choice = choice.masked_fill(smask == 0, float("-inf"))
        idx = choice.topk(self.k, dim=-1, sorted=False)[1]  # [N, k]
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.rsf

    def forward(self, x):  # x [B, T, D]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        idx, w = self.route(x2)
        flat = idx.reshape(-1)  # [N*k]
        counts = torch.bincount(flat, minlength=self.E)
        self.last_load = counts
        order = flat.argsort(stable=True)
        tok = order // self.k
        xs = x2.index_select(0, tok)
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            h = F.linear(xs[start:start + c], self.w_gate_up[e])
            gte, up = h.chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gte) * up, self.w_down[e]))
            start += c
        ys = torch.cat(outs) * w.reshape(-1).index_select(0, order)[:, None].to(outs[0].dtype)
        routed = torch.zeros(x2.shape[0], shape[-1], dtype=ys.dtype).index_add_(0, tok, ys)
        return routed.view(shape).to(x.dtype) + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, c: dict, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MoE(c) if moe else MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """DeepSeek-V3 MTP module (layout of the released checkpoint and of vLLM/SGLang's deepseek MTP):
    h'_i = Block(eh_proj(cat(enorm(emb(t_{i+1})), hnorm(h_i)))), logits = lm_head(shared_head.norm(h'_i)),
    predicting t_{i+2}. h_i is the main model's final hidden state (after model.norm, the lm_head input)."""

    def __init__(self, c: dict):
        super().__init__()
        D = c["hidden_size"]
        self.enorm = RMSNorm(D, c["rms_norm_eps"])
        self.hnorm = RMSNorm(D, c["rms_norm_eps"])
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = Block(c, moe=True)
        self.shared_head_norm = RMSNorm(D, c["rms_norm_eps"])

    def forward(self, h, emb_next, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        return self.shared_head_norm(self.block(x, cos, sin))


class TinyDeepseekV3(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, moe=i >= c["first_k_dense_replace"]) for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.mtp = MTPLayer(c)
        std = c["initializer_range"]
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, ids, with_mtp: bool = True):
        """ids [B, T] -> main logits [B, T, V], mtp logits [B, T-1, V] (position i predicts ids[i+2])."""
        T = ids.shape[1]
        cos, sin = rope_cos_sin(self.c, T)
        emb = self.embed_tokens(ids)
        x = emb
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)
        logits = self.lm_head(h)
        if not with_mtp:
            return logits, None
        hm = self.mtp(h[:, :-1], emb[:, 1:], cos[:-1], sin[:-1])
        return logits, self.lm_head(hm)
