"""Per-operator cost of one engine step on one card (the busiest one), in seconds.

Roofline per operator: max(FLOPs / (peak * eff * serving), bytes / (HBM bw * eff * serving)); the
kernel-level factors `eff` and the end-to-end serving factor come from hardware.yaml (documented facts,
identical for every device and deployment). Communication is in comm.py.
Shapes: q = tokens one DP group runs this step (B sequences x (1 + drafts) in decode), N = tokens of the
whole instance (dp * q), k = top-k routed experts per token, H = hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.planner import comm
from moeserve.planner.deploy import Instance
from moeserve.planner.hardware import Hardware
from moeserve.planner.models import ModelSpec

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


def gemm(hw: Hardware, inst: Instance, name: str, tokens: float, params: float, n_in: float,
         n_out: float, dtype: str | None = None, wbytes: float | None = None) -> Op:
    """tokens x [n_in -> n_out] over `params` weights (several fused matrices allowed)."""
    dtype = dtype or inst.compute_dtype
    wbytes = inst.weight_bytes if wbytes is None else wbytes
    act_in = 1.0 if dtype != "bf16" else ACT
    nbytes = params * wbytes + tokens * (n_in * act_in + n_out * ACT)
    return roofline(hw, name, 2.0 * tokens * params, nbytes, dtype, weight_bytes=params * wbytes)


# ---- attention ----------------------------------------------------------------------------------
def attn_proj(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    """q_a/kv_a (replicated under TP) + q_b, kv_b (absorbed W_UK/W_UV or expansion), o_proj."""
    params = m.q_a_params + m.kv_a_params + m.attn_split_params / inst.tp
    heads = m.num_attention_heads / inst.tp
    n_io = (2 * m.hidden_size + 2 * (m.q_lora_rank or 0) + m.kv_elems_per_token_layer
            + heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + 2 * m.v_head_dim + 2 * m.kv_lora_rank))
    return gemm(hw, inst, "attn_proj", q, params, n_io / 2, n_io / 2)


def mla_decode(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, q_per_seq: float,
               ctx: float) -> Op:
    """Absorbed MLA: each query head scores the 512+64 latent and sums 512-d values, per context token.

    The latent cache is shared by all heads, so TP splits FLOPs but every TP rank reads the full KV.
    """
    heads = m.num_attention_heads / inst.tp
    flops = 2.0 * seqs * q_per_seq * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * ctx
    nbytes = seqs * ctx * m.kv_elems_per_token_layer * inst.kv_bytes
    eff = hw.eff.attention
    return roofline(hw, "mla_decode", flops, nbytes, "bf16", compute_eff=eff, mem_eff=eff)


def attn_prefill(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, new: float,
                 past: float = 0.0) -> Op:
    """Causal MHA over expanded K/V (qk 192, v 128 per head): `new` tokens per seq after `past` cached."""
    heads = m.num_attention_heads / inst.tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    pairs = new * past + new * (new + 1) / 2  # (query, key) pairs under the causal mask
    flops = 2.0 * seqs * heads * (qk + m.v_head_dim) * pairs
    # Q and O for the new tokens, K and V for every token they attend to (cached + new).
    nbytes = seqs * heads * (new + (new + past)) * (qk + m.v_head_dim) * ACT
    eff = hw.eff.attention
    return roofline(hw, "attn_prefill", flops, nbytes, "bf16", compute_eff=eff, mem_eff=eff)


def elementwise(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    """Norms, residual adds, dynamic quantisation; with FlashComm each TP rank does its token shard."""
    tokens = q / inst.tp if inst.flashcomm != "off" else q
    nbytes = ELEMENTWISE_PASSES * tokens * m.hidden_size * ACT
    return roofline(hw, "elementwise", 0.0, nbytes, "bf16")


def tp_allreduce(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> list[Op]:
    """Attention/dense-MLP output reduction inside the TP group.

    Plain: an AllReduce (= ReduceScatter + AllGather) of BF16 rows. FlashComm (system-brief item 7,
    moeserve --flashcomm): ReduceScatter after o_proj, the residual stream stays sharded by token, and
    the AllGather before the next projections moves BF16 ('on') or INT8 rows + fp32 scales ('int8').
    """
    rows = q * m.hidden_size
    if inst.flashcomm == "off":
        return [Op("tp_allreduce", comm.allreduce(hw, inst.tp, rows * ACT), "comm")]
    gather = rows * ACT if inst.flashcomm == "on" else rows + 4.0 * q
    return [Op("tp_reduce_scatter", comm.reduce_scatter(hw, inst.tp, rows * ACT), "comm"),
            Op("tp_allgather", comm.allgather(hw, inst.tp, gather), "comm")]


def dense_mlp(m: ModelSpec, hw: Hardware, inst: Instance, q: float) -> Op:
    i = m.intermediate_size / inst.tp
    return gemm(hw, inst, "dense_mlp", q, m.dense_mlp_params / inst.tp, m.hidden_size + i,
                2 * i + m.hidden_size)


def lm_head(m: ModelSpec, hw: Hardware, inst: Instance, tokens: float) -> Op:
    """Vocab-parallel over TP; BF16 weights (quantising the head costs accuracy)."""
    v = m.vocab_size / inst.tp
    return gemm(hw, inst, "lm_head", tokens, v * m.hidden_size, m.hidden_size, 2 * v,
                dtype="bf16", wbytes=ACT)
