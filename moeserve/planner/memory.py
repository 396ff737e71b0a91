"""Memory per card: weights, KV cache, activations; layouts that do not fit are refused with the reason.

The binding card is the one holding the most weights (a routed-expert rank, or a dedicated shared-expert
rank). KV: MLA's latent is shared by all heads, so attention TP replicates it on every TP rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeserve.perf.cost import ACT
from moeserve.perf.deploy import DoesNotFit, Instance, PlanError
from moeserve.perf.hardware import GIB, Hardware
from moeserve.perf.models import ModelSpec


@dataclass(frozen=True)
class MemoryReport:
    usable: float          # bytes the engine may use on one card
    weights: float         # bytes on the binding card
    activations: float     # peak step workspace
    kv_per_seq: float      # bytes of KV one sequence holds at the given context
    kv_free: float         # bytes left for KV
    max_batch: int         # sequences per DP group that fit
    detail: dict

    @property
    def fits(self) -> bool:
        return self.max_batch >= 1

    def to_dict(self) -> dict:
        g = lambda b: round(b / GIB, 3)
        return {"usable_gib": g(self.usable), "weights_gib": g(self.weights),
                "activations_gib": g(self.activations), "kv_free_gib": g(self.kv_free),
                "kv_per_seq_mib": round(self.kv_per_seq / 2 ** 20, 3), "max_batch_per_dp": self.max_batch,
                "fits": self.fits, "weights_detail_gib": {k: g(v) for k, v in self.detail.items()}}


def check_tp(m: ModelSpec, tp: int, flag: str = "--tp") -> None:
    """Attention TP splits the heads: a TP size that does not divide them cannot run."""
    heads = m.num_attention_heads
    if heads % tp:
        ok = ", ".join(str(t) for t in (1, 2, 4, 8, 16, 32, 64, 128) if heads % t == 0)
        raise PlanError(f"{flag} {tp} does not divide {m.name}'s {heads} attention heads; use one of {ok}")


def weights_per_card(m: ModelSpec, inst: Instance) -> dict[str, float]:
    """Bytes of weights on the routed-expert rank (the larger of the two rank kinds)."""
    check_tp(m, inst.tp)
    w, tp = inst.weight_bytes, inst.tp
    layers = m.num_hidden_layers + m.num_nextn_predict_layers
    moe_layers = m.num_moe_layers + (m.num_nextn_predict_layers if m.n_routed_experts else 0)
    out = {
        "attention": layers * (m.q_a_params + m.kv_a_params + m.attn_split_params / tp) * w,
        "dense_mlp": m.num_dense_layers * m.dense_mlp_params / inst.mlp_tp * w,
        "embed_head": 2 * m.embed_params / tp * ACT,
        "router": moe_layers * m.gate_params * ACT,
        "mtp_eh_proj": m.num_nextn_predict_layers * 2 * m.hidden_size ** 2 * w,
    }
    if m.n_routed_experts:
        slots = inst.expert_slots(m.n_routed_experts)
        routed = moe_layers * slots * m.expert_params * w
        shared = moe_layers * m.n_shared_experts * m.expert_params * w
        # A dedicated shared rank holds only the shared experts; routed ranks then hold none.
        out["experts"] = max(routed, shared) if inst.shared_expert_ranks else routed + shared
    return out


def activation_bytes(m: ModelSpec, inst: Instance, q: float, logit_rows: float | None = None,
                     n_tokens: float | None = None) -> float:
    """Peak workspace of one step: hidden/residual/attention buffers, MoE buffers, logits (fp32).

    q: tokens of this DP group; logit_rows: positions that are sampled (every verified position in
    decode, one per prompt in prefill; default q); n_tokens: tokens over all DP groups (default q x dp),
    which the allgather mode gathers onto every card."""
    h = m.hidden_size
    heads = m.num_attention_heads / inst.tp
    attn = q * heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * m.v_head_dim) * ACT
    n_tokens = q * inst.dp if n_tokens is None else n_tokens
    logit_rows = q if logit_rows is None else logit_rows
    if inst.moe_comm == "allgather":
        moe_buf = n_tokens * h * (1 + ACT)  # gathered INT8 inputs + BF16 partial sums
    else:
        moe_buf = q * m.num_experts_per_tok * h * 3  # send + receive copies
    inter = q * m.num_experts_per_tok * 2 * m.moe_intermediate_size * ACT
    logits = logit_rows * m.vocab_size / inst.tp * 4
    return 4 * q * h * ACT + attn + moe_buf + inter + logits


def memory_report(m: ModelSpec, hw: Hardware, inst: Instance, context: float,
                  step_tokens: float, logit_rows: float | None = None,
                  total_tokens: float | None = None) -> MemoryReport:
    """Memory at mean KV length `context` per sequence and `step_tokens` tokens per DP group per step
    (logit_rows, total_tokens: see activation_bytes)."""
    usable = hw.hbm_bytes * hw.eff.memory_utilization
    detail = weights_per_card(m, inst)
    weights = sum(detail.values())
    act = activation_bytes(m, inst, step_tokens, logit_rows, total_tokens)
    kv_per_seq = context * m.kv_bytes_per_token(inst.kv_bytes, with_mtp=inst.mtp_drafts > 0)
    kv_free = usable - weights - act
    max_batch = int(kv_free // kv_per_seq) if kv_free > 0 and kv_per_seq > 0 else 0
    return MemoryReport(usable, weights, act, kv_per_seq, max(kv_free, 0.0), max_batch, detail)


def refusal_reason(m: ModelSpec, hw: Hardware, inst: Instance, rep: MemoryReport) -> str | None:
    """None when the layout fits, else a message that says what to change."""
    g = lambda b: f"{b / GIB:.1f} GiB"
    if rep.weights + rep.activations > rep.usable:
        if rep.activations > rep.weights:  # the step's workspace, not the weights, is what does not fit
            fix = "put fewer tokens in one step (fewer prompts per batch, shorter prompts) or raise attention TP"
        else:
            fix = (f"spread experts over more ranks (now {inst.ep}), raise attention TP, or quantize "
                   f"(now {inst.quantization})")
        return (f"weights {g(rep.weights)} + activations {g(rep.activations)} exceed {g(rep.usable)} usable "
                f"per card ({hw.hbm_gib:g} GiB x {hw.eff.memory_utilization:g}) on {hw.name}; {fix}")
    if rep.max_batch < 1:
        return (f"only {g(rep.kv_free)} left for KV after weights; one sequence needs {g(rep.kv_per_seq)}; "
                "use more cards per instance, shorter contexts or a smaller KV dtype")
    return None


def check_fits(m: ModelSpec, hw: Hardware, inst: Instance, context: float, step_tokens: float) -> MemoryReport:
    rep = memory_report(m, hw, inst, context, step_tokens)
    reason = refusal_reason(m, hw, inst, rep)
    if reason:
        raise DoesNotFit(reason)
    return rep
