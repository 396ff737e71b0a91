"""Multi-head latent attention (MLA) over a paged latent cache.

The cache holds, per token and layer, only c = kv_a_layernorm(latent) [kv_lora_rank] and the rotated shared
key k_pe [qk_rope_head_dim].
- Prefill (decompressed): k_nope, v = kv_b_proj(c) per head, ordinary attention; cheap for long queries.
- Decode (absorbed): W_UK is folded into q (q_lat = q_nope W_UK), scores = q_lat.c + q_pe.k_pe, the output
  stays in latent space (o_lat = P c) and W_UV is applied after. Reads kv_lora + rope values per token
  instead of heads * (k + v) values.
Tensor parallelism shards the heads over the TP group (q_b/q_proj and kv_b_proj by head, o_proj by input
columns plus an all-reduce); the latent projection and the cache are replicated on the TP ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.comm import timed
from moeserve.distributed.flashcomm import current_seq_parallel
from moeserve.distributed.parallel_state import get_attention_tp_dp_switch, get_tp_group
from moeserve.layers.attention import amla, mla_bmm, mla_kernel
from moeserve.layers.attention.kv_dtype import gather_cache, gather_decode_context, write_cache
from moeserve.layers import opaque
from moeserve.layers.attention.metadata import get_attention_metadata
from moeserve.layers.linear import Linear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding, softmax_scale
from moeserve.arch import DeepseekArch


class MLAttention(nn.Module):
    def __init__(self, arch: DeepseekArch, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = get_tp_group()
        assert arch.num_attention_heads % self.tp.world_size == 0, "checked by check_parallel_layout"
        self.num_heads = arch.num_attention_heads // self.tp.world_size  # local heads
        col = dict(tp_dim=0, tp_rank=self.tp.rank, tp_size=self.tp.world_size)
        self.dn, self.dr, self.dv = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.kv_lora_rank = arch.kv_lora_rank
        h, qk = arch.hidden_size, arch.qk_head_dim
        if arch.q_lora_rank is None:
            self.q_proj = Linear(h, arch.num_attention_heads * qk, **col)
        else:
            self.q_a_proj = Linear(h, arch.q_lora_rank, bias=arch.attention_bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = Linear(arch.q_lora_rank, arch.num_attention_heads * qk, **col)
        self.kv_a_proj_with_mqa = Linear(h, arch.kv_cache_dim, bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(arch.kv_lora_rank, arch.rms_norm_eps)
        self.kv_b_proj = Linear(arch.kv_lora_rank, arch.num_attention_heads * (self.dn + self.dv), **col)
        self.o_proj = Linear(arch.num_attention_heads * self.dv, h, bias=arch.attention_bias,
                             **{**col, "tp_dim": 1})
        self.rotary = rotary
        self.scale = softmax_scale(arch.rope, qk)
        self.w_uk_t: torch.Tensor | None = None  # [H, C, dn] set by process_weights_after_loading
        self.w_uv: torch.Tensor | None = None  # [H, dv, C]
        self.w_uv_t: torch.Tensor | None = None  # [H, C, dv], a view of w_uv
        self.w_uk_packed: torch.Tensor | None = None  # w_uk_t / w_uv in mla_bmm's layout, where it applies
        self.w_uv_packed: torch.Tensor | None = None
        self.op_key = opaque.register(self)

    def process_weights_after_loading(self) -> None:
        # From the dequantized weight when kv_b_proj is INT8: prefill and decode then use the same matrix.
        w = self.kv_b_proj.dequantized_weight().view(self.num_heads, self.dn + self.dv, self.kv_lora_rank)
        # W_UK stored [H, C, dn] and applied weight-first (absorb_query): the same bits as q @ W_UK, and
        # oneDNN's bmm reads it faster that way round (2 MB per layer in the V3-shaped checkpoint, 1 thread, an
        # Intel Xeon with AMX: 192 / 215 / 241 us against 288 / 260 / 291 at batch 1 / 8 / 32, cold weights).
        self.w_uk_t = w[:, : self.dn].transpose(1, 2).contiguous()
        # W_UV stored [H, dv, C] (weight-first, one copy); w_uv_t is its [H, C, dv] view (value_up)
        self.w_uv = w[:, self.dn:].contiguous()
        self.w_uv_t = self.w_uv.transpose(1, 2)
        # BF16 with vLLM's library: both products through its batched GEMM (mla_bmm.py), else the bmm's below
        self.w_uk_packed, self.w_uv_packed = mla_bmm.pack(self.w_uk_t), mla_bmm.pack(self.w_uv)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.dn + self.dr)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (all scheduled tokens; with FlashComm this rank's shard) -> same rows."""
        sp = current_seq_parallel()
        with timed("attention"):
            if sp is None:
                if self.tp.world_size > 1 and torch.compiler.is_compiling():  # the collective stays outside
                    return torch.ops.moeserve.tp_all_reduce(self._attend(x, positions), self.op_key)
                return self.tp.all_reduce(self._attend(x, positions))
            if self.tp_dp_switch:  # TP<->DP switch: the low-rank projections on the shard, then gather them
                return sp.reduce_scatter(self._attend_switched(x, positions, sp))
            # FlashComm: x is this rank's token shard (normed); gather all tokens, scatter the sums back
            return sp.reduce_scatter(self._attend(sp.gather(x), positions))

    @property
    def tp_dp_switch(self) -> bool:
        """--attention-tp-dp-switch applies to the q_lora models (V3; V2-Lite's q_proj needs the hidden)."""
        return get_attention_tp_dp_switch() and hasattr(self, "q_a_proj")

    def _attend(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This rank's heads; o_proj's partial output (summed over the TP group by the caller)."""
        q = self._queries(x)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.dr], dim=-1)
        return self._attend_projected(q, self.kv_a_layernorm(latent), k_pe, positions)

    def _attend_switched(self, x: torch.Tensor, positions: torch.Tensor, sp) -> torch.Tensor:
        """Data-parallel up to the low-rank projections, head-parallel after: x is this rank's token shard;
        q_a (+ its norm) and kv_a (+ the latent's norm) run on it alone, one all-gather brings every rank all
        tokens' [q_lora + kv_lora + rope] values (V3: 2112 per token where FlashComm gathers 7168), and
        q_b / attention / o_proj run on this rank's heads for all tokens."""
        q_lat = self.q_a_layernorm(self.q_a_proj(x))  # [n_r, q_lora]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.dr], dim=-1)
        full = sp.gather(torch.cat([q_lat, self.kv_a_layernorm(latent), k_pe], dim=-1))  # [T, q_lora + C + dr]
        q_lat, latent, k_pe = full.split([q_lat.shape[-1], self.kv_lora_rank, self.dr], dim=-1)
        q = self.q_b_proj(q_lat).view(full.shape[0], self.num_heads, self.dn + self.dr)
        return self._attend_projected(q, latent, k_pe, positions)

    def _attend_projected(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
        """q [T, heads, dn + dr], normed latent [T, C], k_pe [T, dr] (not yet rotated) -> o_proj partial."""
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        new_kv = torch.cat([latent, k_pe], dim=-1)  # [T, C + dr]
        if torch.compiler.is_compiling():  # the cache and the metadata stay outside the graph (layers/opaque.py)
            out = torch.ops.moeserve.mla_attention(q_nope, q_pe, new_kv, self.w_uv_t, self.op_key)
        else:
            out = self.attend_cached(q_nope, q_pe, new_kv)
        return self.o_proj(out)

    def attend_cached(self, q_nope: torch.Tensor, q_pe: torch.Tensor, new_kv: torch.Tensor) -> torch.Tensor:
        """Write the new rows' latent KV and attend: -> [T, H * dv]. Only the metadata's rows are real: a
        compiled decode graph pads its batch to a bucket size, and the rows past them come back zero."""
        meta = get_attention_metadata()
        n = meta.slot_mapping.shape[0]
        cache = meta.kv_caches[self.layer_idx]
        flat_cache = cache.view(-1, cache.shape[-1])  # [num_blocks * block_size, C + dr]
        write_cache(flat_cache, meta.slot_mapping, new_kv[:n])
        t = q_nope.shape[0]
        out = (q_nope.new_empty if n == t else q_nope.new_zeros)(t, self.num_heads * self.dv)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            kv = new_kv[rows] if seq.ctx_len == seq.q_len else gather_cache(flat_cache, seq.slots, new_kv.dtype)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], kv, seq.ctx_len - seq.q_len)
        if meta.decode is not None:  # row gathers and writes by index_select / index_copy_ (3-5x indexing's)
            d = meta.decode
            out.index_copy_(0, d.rows, self._decode(q_nope.index_select(0, d.rows), q_pe.index_select(0, d.rows),
                                                    cache, d))
        return out

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                 offset: int) -> torch.Tensor:
        """Decompressed attention for q_len queries over ctx_len = offset + q_len cached tokens."""
        q_len, ctx_len = q_nope.shape[0], kv.shape[0]
        latent, k_pe = kv.split([self.kv_lora_rank, self.dr], dim=-1)
        kv_up = self.kv_b_proj(latent).view(ctx_len, self.num_heads, self.dn + self.dv)
        k_nope, v = kv_up.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        # SDPA's flash kernel wants V's head dim equal to Q/K's (dn + dr = 192 against dv = 128 in V3): V is
        # zero-padded and the padding sliced off the output (as MLA prefill on flash-attn does). Without it
        # SDPA falls back to its math path: 3.3x slower for a 128-token prompt here (1 thread).
        if v.shape[-1] < k.shape[-1]:
            v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, len, d]: the flash kernel's layout
        if offset == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            allowed = torch.ones(q_len, ctx_len, dtype=torch.bool).tril(diagonal=offset)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return o[0, :, :, : self.dv].transpose(0, 1).reshape(q_len, self.num_heads * self.dv)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, dn] -> the latent query [B, H, C] = q_nope @ W_UK per head (a strided view)."""
        if self.w_uk_packed is not None:
            return mla_bmm.per_head(q_nope, self.w_uk_packed, self.kv_lora_rank)
        return torch.bmm(self.w_uk_t, q_nope.permute(1, 2, 0)).permute(2, 0, 1)

    # Rows up to which value_up applies W_UV weight-first. oneDNN's bmm reads the weight faster that way at
    # few rows and slower at many (2 MB per layer in the V3-shaped checkpoint, 1 thread, Intel Xeon with AMX,
    # cold weights, weight-first / data-first: 133 / 210 us at 1 row, 156 / 216 at 4, 187 / 224 at 8, about
    # equal at 16-32; at 64 rows 690 us against 508 for data-first on the transposed view)
    UV_WEIGHT_FIRST_MAX_ROWS = 32

    def value_up(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [B, H, C] -> [B, H * dv]: each head's latent output through its W_UV."""
        b = o_lat.shape[0]
        if self.w_uv_packed is not None:
            return mla_bmm.per_head(o_lat, self.w_uv_packed, self.dv).view(b, self.num_heads * self.dv)
        if b <= self.UV_WEIGHT_FIRST_MAX_ROWS:
            # [H, dv, B] to rows: contiguous, or the reshape is a column-major view that every later row copy
            # reads element by element (an index_put of its 32 x 2048 rows took ~0.6 ms)
            o = torch.bmm(self.w_uv, o_lat.permute(1, 2, 0)).permute(2, 0, 1).contiguous()  # [B, H, dv]
        else:
            o = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)
        return o.reshape(b, self.num_heads * self.dv)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                d) -> torch.Tensor:
        """Absorbed attention: one query per sequence, reading only the latent cache."""
        if amla.decode_impl() != "standard":  # --mla-decode amla: exponent-add rescaling (amla.py)
            return amla.decode(self, q_nope, q_pe, cache, d)
        q_full = torch.cat([self.absorb_query(q_nope), q_pe], dim=-1)  # [B, H, C + dr]
        if mla_kernel.applies(q_full, cache, d):  # BF16: vLLM's CPU kernel reads the paged cache in place
            return self.value_up(mla_kernel.decode_latent(q_full, cache, d, self.scale, self.kv_lora_rank))
        kv = gather_decode_context(cache, d, q_nope.dtype)[:, None]  # [B, 1, L, C + dr]: one KV head
        # Each row's H heads as the queries of one head over its latent context (MQA): SDPA's flash kernel
        # fuses scores, softmax (float32) and the value product. The values are the whole C + dr columns,
        # sliced after (the kernel wants V's width equal to K's). Against two bmm's and an eager softmax
        # (benchmarks/mla_decode.py: one thread, 16 heads, V3's latent dims): 1.87x at 1 row x 128 context,
        # 1.42x at 8 x 128, 1.48x at 32 x 128, 1.52x at 32 x 1024, and 3-5x closer to a float32 reference
        o = F.scaled_dot_product_attention(q_full[:, None], kv, kv, attn_mask=~d.mask[:, None, None, :],
                                           scale=self.scale)  # [B, 1, H, C + dr]
        return self.value_up(o[:, 0, :, : self.kv_lora_rank])
