"""Logits from an lm_head, and the INT8 head's re-scored top candidates.

An A8W8 lm_head reads half the bytes of a BF16 one (at batch 1 it is the largest GEMV of a decode step), but
quantizing its input per token moves near-tied logits: on the bundled model the INT8 head cost greedy
agreement with BF16 ~0.002 (9 of 4096 teacher-forced positions) where INT8 weights with unquantized
activations cost nothing measurable (docs/quantization.md, "The INT8 lm_head's top candidates, re-scored").
Only the top of the distribution decides a greedy token and carries almost all of a sampled one's
probability, so the head runs the fast W8A8 GEMM over the whole vocabulary, then recomputes its TOP_CANDIDATES
highest logits per row from the same INT8 weights with the activations as they are (float32 dot products of a
few gathered rows): no second copy of the weights, a few KB read per row.
"""
from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.quant import Int8LinearMethod

# Candidates re-scored per row: the W8A8 logits of the true top token sit within a few ranks of the top.
TOP_CANDIDATES = 8
# Re-scoring works on row blocks whose float32 candidate rows stay under 16 MB (a prefill asking for prompt
# logprobs sends thousands of rows; V3's 7168-wide head gives 73-row blocks, the bench model's 512).
CHUNK_ELEMENTS = 1 << 22


def head_logits(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, V] of head(x); an INT8 head's top candidates re-scored (rescore_top)."""
    out = head(x)
    logits = out.float()
    if getattr(head, "quant_method", None) is Int8LinearMethod:
        rescore_top(logits, x, head.weight, head.weight_scale, head.bias, out_dtype=out.dtype)
    return logits


def rescore_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, k: int = TOP_CANDIDATES,
                out_dtype: torch.dtype = torch.float32) -> None:
    """In place: each row's k highest logits become x . (weight[j] * scale[j]) (+ bias[j]), from int8 weight
    [V, H] and per-channel scale [V, 1] with x [n, H] unquantized; computed in float32 and rounded to
    out_dtype, the precision the head wrote the other logits in (so ties between candidates break as in a
    float head of that dtype: the first index)."""
    k = min(k, logits.shape[-1])
    if logits.shape[0] == 0 or k == 0:
        return
    top = top_candidates(logits, k)  # [n, k]
    step = max(1, CHUNK_ELEMENTS // (k * x.shape[-1]))  # rows a float32 [rows, k, H] temporary may take
    exact = torch.cat([_candidate_logits(x[i:i + step], weight, top[i:i + step])
                       for i in range(0, x.shape[0], step)])
    exact = exact * scale.reshape(-1)[top]
    if bias is not None:
        exact = exact + bias.float()[top]
    logits.scatter_(-1, top, exact.to(out_dtype).float())


def _candidate_logits(x: torch.Tensor, weight: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """sum_h x[i, h] * weight[top[i, j], h] in float32 -> [n, k] (before the channel scales)."""
    rows = weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)  # [n, k, H] int8
    return (rows * x.float().unsqueeze(1)).sum(-1)


def top_candidates(logits: torch.Tensor, k: int, chunk: int = 128) -> torch.Tensor:
    """Indices of each row's k largest logits [n, k] (in no set order). torch.topk over a 32000-entry row
    costs ~38 us on one core here, 1.2 ms at batch 32; this takes the max of each chunk of 128 logits (one
    vectorized pass), then only the k chunks with the highest maxima, which hold every top-k entry: ~6x
    faster. Vocabularies that are not whole chunks take topk."""
    n, v = logits.shape
    if v % chunk or v // chunk < k:
        return logits.topk(k, dim=-1).indices
    best = logits.view(n, v // chunk, chunk).amax(-1).topk(k, dim=-1).indices  # [n, k] chunks
    idx = (best.unsqueeze(-1) * chunk + torch.arange(chunk, device=logits.device)).view(n, k * chunk)
    return idx.gather(-1, logits.gather(-1, idx).topk(k, dim=-1).indices)
