"""Per-operator cost of one engine step on one card (the busiest one), in seconds.

Roofline per operator: max(FLOPs / (peak * compute eff), bytes / (HBM bw * memory eff)), with the
efficiencies measured for that operator class on that device family (data/hardware.yaml, kernels.md):
GEMMs compute at `gemm` and stream weights at `gemm_memory` (DeepGEMM / CANN: a small-M GEMM is
memory-bound, so its achieved FLOP rate grows with M until the compute roof; gemm_efficiency), MLA decode
computes at `attention` and streams KV at `attention_memory` (FlashMLA / CANN MLA; memory- or
compute-bound by heads x query length), elementwise passes stream at `memory`. `serving` (1.0 unless a
user file sets one) scales every compute operator. Communication is in comm.py.
Shapes: q = tokens one DP group runs this step (B sequences x (1 + drafts) in decode), N = tokens of the
whole instance (dp * q), k = top-k routed experts per token, H = hidden size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeserve.perf import comm
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec

ACT = 2.0  # bytes per activation element between kernels (BF16)
# bf16 passes over a [q, H] tensor per decoder layer outside GEMMs: 2 RMSNorms (read+write = 2 each),
# 2 residual adds (read 2, write 1 each), dynamic INT8 quantisation before 3 GEMM inputs (read 1 each).
ELEMENTWISE_PASSES = 2 * 2 + 2 * 3 + 3


@dataclass
class Op:
    name: str
    seconds: float       # per step, all layers
    kind: str            # 'compute' or 'comm'
    flops: float = 0.0
    nbytes: float = 0.0  # HBM bytes (compute) or link bytes are not tracked (comm)
    prefetchable: float = 0.0  # seconds of weight reads the op waits on beyond its FLOPs (prefetch can hide)


@dataclass
class Step:
    ops: list[Op] = field(default_factory=list)
    overhead: float = 0.0
    overlapped: bool = False
    total: float = 0.0   # seconds, after overlap

    def add(self, op: Op, times: float = 1.0) -> None:
        if times and op.seconds:
            self.ops.append(Op(op.name, op.seconds * times, op.kind, op.flops * times, op.nbytes * times,
                               op.prefetchable * times))

    def seconds(self, kind: str) -> float:
        return sum(o.seconds for o in self.ops if o.kind == kind)

    def by_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for o in self.ops:
            out[o.name] = out.get(o.name, 0.0) + o.seconds
        return out

    @property
    def hbm_bytes(self) -> float:
        return sum(o.nbytes for o in self.ops)


def roofline(hw: Hardware, name: str, flops: float, nbytes: float, dtype: str,
             compute_eff: float | None = None, mem_eff: float | None = None,
             weight_bytes: float = 0.0) -> Op:
    """`weight_bytes` (part of `nbytes`): what could be fetched ahead of the op."""
    peak = hw.peak_flops(dtype) * (compute_eff or hw.eff.gemm) * hw.eff.serving
    bw = hw.hbm_bw * (mem_eff or hw.eff.memory) * hw.eff.serving
    t_flops, t_mem = flops / peak, nbytes / bw
    return Op(name, max(t_flops, t_mem), "compute", flops, nbytes,
              min(max(0.0, t_mem - t_flops), weight_bytes / bw))


def gemm_mem_eff(hw: Hardware) -> float:
    """HBM fraction a GEMM streams its weights at: `gemm_memory` (DeepGEMM / CANN small-M figures) under
    the small_m_gemm term, else the generic streaming fraction `memory`."""
    return hw.eff.gemm_mem if hw.eff.has("small_m_gemm") else hw.eff.memory


def gemm_roofline(hw: Hardware, name: str, flops: float, nbytes: float, dtype: str,
                  weight_bytes: float = 0.0) -> Op:
    return roofline(hw, name, flops, nbytes, dtype, mem_eff=gemm_mem_eff(hw), weight_bytes=weight_bytes)


def gemm_efficiency(hw: Hardware, dtype: str, m: float, n: float, k: float, wbytes: float = 1.0) -> float:
    """Achieved / peak FLOP rate of one [m, k] x [k, n] GEMM (weights `wbytes` per element, 1-byte inputs,
    BF16 outputs): the roofline's M dependence, memory-bound below the ridge (kernels.md DeepGEMM M=64 /
    128 / 4096 rows)."""
    flops = 2.0 * m * n * k
    nbytes = n * k * wbytes + m * k + m * n * ACT
    op = gemm_roofline(hw, "gemm", flops, nbytes, dtype)
    return flops / op.seconds / hw.peak_flops(dtype)


def gemm(hw: Hardware, inst: Instance, name: str, tokens: float, params: float, n_in: float,
         n_out: float, dtype: str | None = None, wbytes: float | None = None) -> Op:
    """tokens x [n_in -> n_out] over `params` weights (several fused matrices allowed)."""
    dtype = dtype or inst.compute_dtype
    wbytes = inst.weight_bytes if wbytes is None else wbytes
    act_in = inst.act_in_bytes if dtype == inst.compute_dtype else (1.0 if dtype != "bf16" else ACT)
    nbytes = params * wbytes + tokens * (n_in * act_in + n_out * ACT)
    return gemm_roofline(hw, name, 2.0 * tokens * params, nbytes, dtype, weight_bytes=params * wbytes)


# ---- attention ----------------------------------------------------------------------------------
def attn_proj(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    """q_a/kv_a + q_b, kv_b (absorbed W_UK/W_UV or expansion), o_proj.

    Under attention TP, q_a/kv_a are replicated: every TP rank runs them over all q tokens, unless the
    residual stream is sharded by token (FlashComm, sequence parallel): then each rank runs them on its
    own q/tp tokens and all-gathers their outputs (attn_sp_comm; hardware.md's A2 prefill layout).
    """
    heads = m.num_attention_heads / inst.tp
    n_a = 2 * m.hidden_size + 2 * (m.q_lora_rank or 0) + m.kv_elems_per_token_layer
    n_b = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + 2 * m.v_head_dim + 2 * m.kv_lora_rank)
    if not _seq_parallel(inst):  # one fused pass over all q tokens
        params = m.q_a_params + m.kv_a_params + m.attn_split_params / inst.tp
        return gemm(hw, inst, "attn_proj", q, params, (n_a + n_b) / 2, (n_a + n_b) / 2)
    a_tokens = q / inst.tp
    a = gemm(hw, inst, "attn_proj", a_tokens, m.q_a_params + m.kv_a_params, n_a / 2, n_a / 2)
    b = gemm(hw, inst, "attn_proj", q, m.attn_split_params / inst.tp, n_b / 2, n_b / 2)
    return Op("attn_proj", a.seconds + b.seconds, "compute", a.flops + b.flops, a.nbytes + b.nbytes,
              a.prefetchable + b.prefetchable)


def _seq_parallel(inst: Instance) -> bool:
    return inst.seq_parallel


def mla_decode(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, q_per_seq: float,
               ctx: float) -> Op:
    """Absorbed MLA: each query head scores the 512+64 latent and sums 512-d values, per context token.

    The latent cache is shared by all heads, so TP splits FLOPs but every TP rank reads the full KV.
    Memory-bound (KV at `attention_memory`) while heads x q_len is below the ridge, compute-bound (at
    `attention`) above it: FlashMLA's "compute-bound once heads x q_len >= 128" on H800 is where these two
    measured rates cross. A kernel tile computes at least `mla_min_rows` query rows (mla_rows).
    """
    rows = mla_rows(hw, m.num_attention_heads / inst.tp * q_per_seq)
    flops = 2.0 * seqs * rows * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * ctx
    nbytes = seqs * ctx * m.kv_elems_per_token_layer * inst.kv_bytes
    # A device may carry its decode-MLA kernel's measured rate (AMLA on the 910C die) instead of a fraction.
    rate = hw.eff.attention if hw.eff.mla_tflops is None else hw.eff.mla_tflops * 1e12 / hw.peak_flops("bf16")
    if inst.attention_dtype == "fp8":
        if not hw.fp8_tflops:
            raise ValueError(f"{hw.name} has no FP8 tensor path for --attention-dtype fp8; use bf16")
        # FP8 MLA's measured speed-up over the BF16 kernel on this family; none measured: BF16's rate
        # (the KV bytes still halve through the FP8 cache).
        rate *= 1.0 + (hw.eff.mla_fp8_gain or 0.0)
    return roofline(hw, "mla_decode", flops, nbytes, "bf16", compute_eff=rate, mem_eff=hw.eff.attn_mem)


def mla_rows(hw: Hardware, rows: float) -> float:
    """Query rows one sequence's decode attention computes: heads x q_len, rounded up to whole tiles of
    `mla_min_rows` under the mla_tile term (FlashMLA on H20: 16 heads reach 25% of HBM, kernels.md, which
    the 16 rows padded to a 64-row tile at FlashMLA's measured compute rate account for)."""
    tile = hw.eff.mla_min_rows if hw.eff.has("mla_tile") else 1.0
    return math.ceil(rows / tile - 1e-9) * tile if tile > 1 else rows


def attn_prefill(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, new: float,
                 past: float = 0.0) -> Op:
    """Causal MHA over expanded K/V (qk 192, v 128 per head): `new` tokens per seq after `past` cached."""
    heads = m.num_attention_heads / inst.tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    pairs = new * past + new * (new + 1) / 2  # (query, key) pairs under the causal mask
    flops = 2.0 * seqs * heads * (qk + m.v_head_dim) * pairs
    # Q and O for the new tokens, K and V for every token they attend to (cached + new).
    nbytes = seqs * heads * (new + (new + past)) * (qk + m.v_head_dim) * ACT
    return roofline(hw, "attn_prefill", flops, nbytes, "bf16", compute_eff=hw.eff.attention,
                    mem_eff=hw.eff.attn_mem)


def elementwise(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    """Norms, residual adds, dynamic quantisation; with FlashComm each TP rank does its token shard."""
    tokens = q / inst.tp if inst.flashcomm != "off" else q
    nbytes = ELEMENTWISE_PASSES * tokens * m.hidden_size * ACT
    return roofline(hw, "elementwise", 0.0, nbytes, "bf16")


def tp_allreduce(m: ModelSpec, hw: Hardware, inst: Instance, q: float, group: int | None = None,
                 rows_tokens: float | None = None) -> list[Op]:
    """A block's output reduction inside its TP group (`group`, default attention TP, over `rows_tokens`
    tokens, default q).

    Plain: an AllReduce (= ReduceScatter + AllGather) of BF16 rows. FlashComm (system-brief item 7,
    moeserve --flashcomm): ReduceScatter after the block, the residual stream stays sharded by token, and
    the AllGather before the next block moves BF16 ('on') or INT8 rows + fp32 scales ('int8').
    """
    group = inst.tp if group is None else group
    tokens = q if rows_tokens is None else rows_tokens
    rows = tokens * m.hidden_size
    if inst.flashcomm == "off":
        return [Op("tp_allreduce", comm.allreduce(hw, group, rows * ACT), "comm")]
    gather = rows * ACT if inst.flashcomm == "on" else rows + 4.0 * tokens
    return [Op("tp_reduce_scatter", comm.reduce_scatter(hw, group, rows * ACT), "comm"),
            Op("tp_allgather", comm.allgather(hw, group, gather), "comm")]


def attn_comm(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> list[Op]:
    """Attention TP communication. Sequence parallel (FlashComm with TP > 1; hardware.md's A2 prefill:
    "q_a / kv_a projections on each card's token shard then an all-gather ... output by all-to-all inside
    the node + row-parallel o_proj + reduce-scatter across nodes"): the gather moves the q latent (INT8 +
    scale under 'int8', system-brief item 7) and the BF16 kv latent, not the hidden state. Across nodes
    the heads' outputs are exchanged inside the node (each card then holds its node's heads for 1/S of the
    tokens) and only the o_proj partial sums cross, reduce-scattered over the nodes. Else tp_allreduce."""
    if not _seq_parallel(inst):
        return tp_allreduce(m, hw, inst, q)
    q_lat = (m.q_lora_rank or 0) * (1.0 if inst.flashcomm == "int8" else ACT) + 4.0
    gather = q * (q_lat + m.kv_elems_per_token_layer * ACT)
    ops = [Op("tp_allgather", comm.allgather(hw, inst.tp, gather), "comm")]
    s = min(hw.scale_up_domain, inst.tp)
    nodes = inst.tp // s
    if nodes <= 1:
        return ops + [Op("tp_reduce_scatter", comm.reduce_scatter(hw, inst.tp, q * m.hidden_size * ACT), "comm")]
    heads = m.num_attention_heads / inst.tp
    a2a = q * heads * m.v_head_dim * ACT * (s - 1) / s
    rs_out = q / s * m.hidden_size * ACT * (nodes - 1) / nodes
    return ops + [Op("tp_alltoall", comm.payload_time(hw, a2a, 0.0) + comm.hop_latency(hw, 1, 0), "comm"),
                  Op("tp_reduce_scatter", comm.payload_time(hw, 0.0, rs_out) + comm.hop_latency(hw, 0, nodes - 1),
                     "comm")]


def dense_mlp(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    """Dense-layer MLP at TP `mlp_tp`: with a dense TP below the attention TP each MLP group serves its
    share of the tokens (q x mlp_tp / tp per card)."""
    tp = inst.mlp_tp
    i = m.intermediate_size / tp
    return gemm(hw, inst, "dense_mlp", q * tp / inst.tp, m.dense_mlp_params / tp, m.hidden_size + i,
                2 * i + m.hidden_size)


def lm_head(m: ModelSpec, hw: Hardware, inst: Instance, tokens: float) -> Op:
    """Vocab-parallel over TP; BF16 weights (quantising the head costs accuracy)."""
    v = m.vocab_size / inst.tp
    return gemm(hw, inst, "lm_head", tokens, v * m.hidden_size, m.hidden_size, 2 * v,
                dtype="bf16", wbytes=ACT)
