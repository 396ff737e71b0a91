"""The DeepSeek-V3 MTP layer (decoder index num_hidden_layers in the checkpoint), built and loaded.

    h'_i = Block(eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]))      # [T, H]
    logits_i = head(shared_head.norm(h'_i))                          # predicts t_{i+2}

h_i is the main model's final hidden state (after model.norm, the lm_head input); the embedding and the head
are the main model's (a `shared_head.head` in the checkpoint is used when present; a repeated
`embed_tokens` copy is skipped). Block is an ordinary DecoderLayer (MLA + MoE) with its own KV cache.
Re-applying the layer to its own h' gives the drafts after the first.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from moeserve.layers.linear import Linear
from moeserve.layers.logits_head import head_logits
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.config import QuantConfig
from moeserve.arch import DeepseekArch
from moeserve.models.deepseek_v3 import DecoderLayer
from moeserve.models.loader import CheckpointError, load_named_tensors
from moeserve.models.quantization import apply_quantization
from moeserve.models.registry import _default_dtype

logger = logging.getLogger(__name__)


class SharedHead(nn.Module):
    def __init__(self, arch: DeepseekArch, has_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # nn.Linear like the main lm_head, so quantization leaves it in the model dtype too
        self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False) if has_head else None


class MTPLayer(DecoderLayer):
    """A DecoderLayer plus the MTP input projection; a subclass so the block's tensors keep the checkpoint
    names (model.layers.{L}.self_attn.*, .mlp.*, ...) next to enorm/hnorm/eh_proj/shared_head."""

    def __init__(self, arch: DeepseekArch, layer_idx: int, rotary: RotaryEmbedding, has_head: bool) -> None:
        super().__init__(arch, layer_idx, rotary)
        h = arch.hidden_size
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.shared_head = SharedHead(arch, has_head)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor,  # type: ignore[override]
                positions: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] of t_{i+1}, prev_hidden [T, H] = h_i, positions [T] = i -> h'_i [T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return super().forward(x, positions)


class DeepseekMTP(nn.Module):
    """Holds the MTP layer under its checkpoint path, model.layers.{L}, so the main loader fills it."""

    def __init__(self, arch: DeepseekArch, rotary: RotaryEmbedding, has_head: bool) -> None:
        super().__init__()
        self.arch = arch
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(arch.num_hidden_layers): MTPLayer(
            arch, arch.num_hidden_layers, rotary, has_head)})

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.arch.num_hidden_layers)]

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layer(embeds, prev_hidden, positions)

    def compute_logits(self, hidden: torch.Tensor, main_head: nn.Module) -> torch.Tensor:
        """[T, H] -> float32 logits [T, V], through shared_head.norm and the MTP layer's own head, or the main
        model's lm_head (in whatever form it runs: packed BF16, INT8) where the checkpoint shares it."""
        sh = self.layer.shared_head
        return head_logits(sh.head if sh.head is not None else main_head, sh.norm(hidden))


def missing_mtp_layer(arch) -> str:
    """What a user reads when --speculative-config asks for an MTP layer the checkpoint lacks."""
    return (f"--speculative-config method 'mtp' needs the checkpoint's MTP layer (model.layers."
            f"{arch.num_hidden_layers}.*, num_nextn_predict_layers = {arch.num_nextn_predict_layers} in "
            "config.json) and this checkpoint has none; drop --speculative-config or use a checkpoint that "
            "ships its MTP layer")


COMPARE_ROWS = 8192  # vocabulary rows per block in repeats_main_head (V3's: 235 MB of float32 at a time)


def repeats_main_head(weight: torch.Tensor, main_head: nn.Module) -> bool:
    """Whether the checkpoint's MTP head `weight` is the main lm_head's: the same values in the model dtype
    (the released DeepSeek-V3 checkpoint stores a copy of lm_head there, 1.85 GB in BF16), or for an INT8
    main head the same quantized bits. A head sharded by tensor parallelism or in another format is not
    compared: the MTP layer keeps its own."""
    from moeserve.int8 import quantize_per_channel
    from moeserve.layers.quant import Int8LinearMethod

    mine = getattr(main_head, "weight", None)
    method = getattr(main_head, "quant_method", None)
    if mine is None or mine.shape != weight.shape or not weight.is_floating_point() or \
            method not in (None, Int8LinearMethod):  # FP8 and others: not compared
        return False
    for i in range(0, weight.shape[0], COMPARE_ROWS):  # in row blocks: no whole-head float32 temporaries
        rows = slice(i, i + COMPARE_ROWS)
        if method is Int8LinearMethod:  # quantized at load from the same tensor, per row
            q, scale = quantize_per_channel(weight[rows])
            same = torch.equal(q, mine[rows]) and torch.equal(scale, main_head.weight_scale[rows])
        else:
            same = torch.equal(weight[rows].to(mine.dtype), mine[rows])
        if not same:
            return False
    return True


def build_mtp(main_model: nn.Module, mtp_weights: dict[str, torch.Tensor], dtype: torch.dtype,
              quant: QuantConfig | None = None) -> DeepseekMTP:
    """The MTP layer of a loaded main model, from the tensors its loader set aside (quantized like it)."""
    arch = main_model.arch
    prefix = f"model.layers.{arch.num_hidden_layers}."
    weights = {n: t for n, t in mtp_weights.items() if n.startswith(prefix)}
    if not weights:
        raise CheckpointError(missing_mtp_layer(arch))
    weights.pop(prefix + "embed_tokens.weight", None)  # a copy of the main embedding, which is used instead
    head = prefix + "shared_head.head.weight"
    if head in weights and repeats_main_head(weights[head], main_model.lm_head):
        del weights[head]  # a copy of lm_head (DeepSeek-V3 ships one): the main head is used, already packed
    if arch.num_nextn_predict_layers > 1:
        logger.info("using MTP layer %d of %d; k > 1 re-applies it", 1, arch.num_nextn_predict_layers)
    with torch.device("meta"), _default_dtype(dtype):
        mtp = DeepseekMTP(arch, main_model.model.rotary, has_head=prefix + "shared_head.head.weight" in weights)
        apply_quantization(mtp, quant or QuantConfig())
    mtp.to_empty(device="cpu")
    load_named_tensors(mtp, weights.items())
    for module in mtp.modules():
        if module is not mtp and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return mtp.eval()
