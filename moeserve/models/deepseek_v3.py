"""DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, written like single-device code.

Inputs are the flat token batch of one engine step (input_ids [T], positions [T]); per-sequence attention
state comes from the attention context the model runner sets. Parameter names follow the Hugging Face
checkpoint, except routed experts, which are stacked per layer (see layers/moe/experts.py).
"""
from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.flashcomm import sequence_parallel
from moeserve.distributed.parallel_state import get_flashcomm, get_tp_group
from moeserve.layers.attention.metadata import attention_context
from moeserve.layers.attention.mla import MLAttention
from moeserve.layers.linear import Linear
from moeserve.layers.logits_head import head_logits
from moeserve.layers.mlp import DenseMLP
from moeserve.layers.moe.layer import MoE
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.arch import DeepseekArch


class DecoderLayer(nn.Module):
    def __init__(self, arch: DeepseekArch, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = MLAttention(arch, layer_idx, rotary)
        self.mlp = MoE(arch, layer_idx) if arch.is_moe_layer(layer_idx) else DenseMLP(
            arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)


class DeepseekModel(nn.Module):
    def __init__(self, arch: DeepseekArch, max_positions: int) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(arch.qk_rope_head_dim, max_positions, arch.rope, arch.rope_interleave)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, self.rotary) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, run_layer=None) -> torch.Tensor:
        """run_layer(layer, x, positions), when given, runs each decoder layer (the compiled decode graphs:
        engine/compiled_decode.py)."""
        x = self.embed_tokens(input_ids)
        # FlashComm (distributed/flashcomm.py): with --flashcomm the residual stream is this TP rank's
        # share of the tokens; otherwise shard/gather are the identity.
        with sequence_parallel(get_tp_group(), get_flashcomm(), x.shape[0]) as sp:
            x = sp.shard(x)
            for layer in self.layers:
                x = layer(x, positions) if run_layer is None else run_layer(layer, x, positions)
            return sp.gather(self.norm(x), allow_int8=False)

    def forward_dbo(self, batches: list[tuple[torch.Tensor, torch.Tensor, object]]) -> list[torch.Tensor]:
        """--enable-dbo: two micro-batches [(input_ids, positions, attention metadata)] through the layers,
        interleaved so that each one's MoE transfers are in flight while the other computes. Per MoE layer:
        attention(0), start(0) | attention(1), start(1) | middle(0) | middle(1) | finish(0) at the next
        layer's top, where it waits for the way back that middle(1) and attention(1) ran under. Every rank
        runs this same sequence (empty micro-batches too), so the collectives pair up. (TP 1, no FlashComm.)"""
        xs = [self.embed_tokens(ids) for ids, _, _ in batches]
        pending: list = [None] * len(batches)  # (residual, MoE state) waiting for its combine
        for layer in self.layers:
            states = []
            for i, (_, positions, meta) in enumerate(batches):
                if pending[i] is not None:
                    residual, state = pending[i]
                    xs[i], pending[i] = residual + layer_finish(state), None
                with attention_context(meta):
                    xs[i] = xs[i] + layer.self_attn(layer.input_layernorm(xs[i]), positions)
                h = layer.post_attention_layernorm(xs[i])
                if layer.is_moe:
                    states.append(layer.mlp.start(h, micro_batch=i))
                else:
                    xs[i] = xs[i] + layer.mlp(h)
                    states.append(None)
            for i, state in enumerate(states):
                if state is not None:
                    pending[i] = (xs[i], (layer.mlp, layer.mlp.middle(state)))
        for i, p in enumerate(pending):
            if p is not None:
                xs[i] = p[0] + layer_finish(p[1])
        return [self.norm(x) for x in xs]


def layer_finish(state: tuple) -> torch.Tensor:
    moe, inner = state
    return moe.finish(inner)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, arch: DeepseekArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.model = DeepseekModel(arch, max_positions)
        # A Linear like the projections: A8W8 makes it INT8 too (models/quantization.py), else oneDNN-packed
        # BF16; at batch 1 it is the largest GEMV of a decode step (65 MB of the bench model's 247 MB).
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, run_layer=None) -> torch.Tensor:
        """-> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, run_layer)

    def forward_dbo(self, batches: list) -> list[torch.Tensor]:
        return self.model.forward_dbo(batches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self.lm_head, hidden)

    def process_weights_after_loading(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.load_tied(self.model.embed_tokens.weight)
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


DeepseekV2ForCausalLM = DeepseekV3ForCausalLM  # one implementation; the config selects router and rope
