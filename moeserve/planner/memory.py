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


# ---- surviving rank losses (--elastic-ep-losses; moeserve --enable-elastic-ep, engine/elastic.py) ----------

@dataclass(frozen=True)
class SurvivalReport:
    """What a layout needs to keep serving after `losses` lost DP groups (docs/planner.md "Surviving rank
    losses"). A loss takes one DP group: its `tp` cards (attention TP cannot run without a member; moeserve's
    elastic EP runs TP 1, where that is one rank). Lost cards are routed-expert ranks, the ones holding unique
    experts (a dedicated shared-expert rank holds only the replicated shared experts)."""
    losses: int
    lost_cards: int
    survivors: int            # routed-expert ranks left (0: nothing survives)
    slots_before: int         # routed-expert slots per routed rank, healthy
    slots_after: int          # per surviving routed rank (0 when nothing survives)
    redundant_after: int      # instance-wide redundant slots after the survivors' re-placement
    healthy: MemoryReport
    degraded: MemoryReport | None
    healthy_sequences: int    # decode sequences the instance holds (max batch x DP groups)
    degraded_sequences: int
    redundant_have: int
    redundant_needed: int     # slots giving every expert losses + 1 copies (refill from a surviving replica)
    replicated: MemoryReport | None  # the healthy layout with redundant_needed slots (None: cannot exist)
    replicated_reason: str | None    # why that layout does not fit (None: it fits)
    host_copy_card: float     # bytes of the routed experts one card holds (what a lost card takes away)
    host_copy_node: float     # bytes of the distinct routed experts of one node's cards
    cards_per_node: int
    reason: str | None        # why the layout cannot survive (None: it can)
    node_given: bool = True   # cards_per_node was given (else the scale-up domain stood in for it)

    @property
    def survives(self) -> bool:
        return self.reason is None

    @property
    def carries_load(self) -> bool:
        """The survivors hold every sequence the healthy instance ran (none waits for KV room)."""
        return self.survives and self.degraded_sequences >= self.healthy_sequences

    @property
    def replicas_cover(self) -> bool:
        """The layout already holds the slots for a surviving replica of every expert."""
        return self.redundant_have >= self.redundant_needed

    @property
    def refill(self) -> str:
        """Where the lost experts come from: replicas held by survivors, else a host copy / the checkpoint."""
        return "replicas" if self.replicas_cover else "host copy or checkpoint"

    def to_dict(self) -> dict:
        g = lambda b: round(b / GIB, 3)
        rep = self.replicated
        return {"losses": self.losses, "lost_cards": self.lost_cards, "surviving_expert_ranks": self.survivors,
                "experts_per_card_before": self.slots_before, "experts_per_card_after": self.slots_after,
                "redundant_after": self.redundant_after, "survives": self.survives, "refused": self.reason,
                "healthy_sequences": self.healthy_sequences, "degraded_sequences": self.degraded_sequences,
                "carries_load": self.carries_load,
                "degraded_memory": self.degraded.to_dict() if self.degraded else None,
                "redundant_experts": self.redundant_have, "redundant_for_replicas": self.redundant_needed,
                "replicas_cover": self.replicas_cover,
                "replicated_weights_gib": g(rep.weights) if rep else None,
                "replicated_max_batch_per_dp": rep.max_batch if rep else None,
                "replicated_refused": self.replicated_reason,
                "host_copy_gib_per_card": g(self.host_copy_card), "host_copy_gib_per_node": g(self.host_copy_node),
                "cards_per_node": self.cards_per_node,
                "host_copy_needed": not self.replicas_cover}


def survivor_redundant(n_routed: int, redundant: int, ep: int, losses: int, tp: int = 1) -> tuple[int, int]:
    """(routed ranks left, redundant slots) after `losses` DP groups of `tp` cards, as the engine re-places
    (engine/elastic.survivor_parallel, applied to the start-up layout, dp_worker's base_config, in every
    epoch): the start-up redundant slots topped up to the fewest that spread over the survivors. (0, redundant)
    when none is left."""
    alive = ep - losses * tp
    if alive < 1:
        return 0, redundant
    return alive, redundant + (-(n_routed + redundant) % alive if n_routed else 0)


def replica_redundant(n_routed: int, ep: int, losses: int) -> int:
    """Redundant slots giving every routed expert losses + 1 copies (each on another DP group, so one
    survives any `losses` losses), topped up to divide over the `ep` routed ranks."""
    total = (losses + 1) * n_routed
    return total + (-total % ep) - n_routed if n_routed else 0


def survival_report(m: ModelSpec, hw: Hardware, inst: Instance, wl, losses: int,
                    cards_per_node: int | None = None) -> SurvivalReport:
    """Memory after `losses` lost DP groups (decode at the workload's mean context, as decode_memory) and
    what refills the lost experts without a checkpoint read. cards_per_node: cards sharing one host's memory
    (default: the scale-up domain, a node of an 8-card HGX / Atlas server)."""
    from dataclasses import replace
    from moeserve.planner.analysis import decode_memory
    if losses < 0:
        raise PlanError(f"--elastic-ep-losses must be >= 0, got {losses}")
    n = m.n_routed_experts
    k = min(cards_per_node or hw.scale_up_domain, inst.cards)
    healthy = decode_memory(m, hw, inst, wl)
    slots = inst.expert_slots(n) if n else 0
    lost = losses * inst.tp
    alive, red_after = survivor_redundant(n, inst.redundant_experts, inst.ep, losses, inst.tp)
    degraded, reason, after = None, None, None
    if losses and alive < 1:
        reason = (f"{losses} lost DP group(s) of {inst.tp} card(s) leave no routed-expert rank of {inst.ep}: "
                  "use more cards or fewer --elastic-ep-losses")
    else:
        after = replace(inst, cards=inst.cards - lost, redundant_experts=red_after)
        degraded = decode_memory(m, hw, after, wl)
        why = refusal_reason(m, hw, after, degraded)
        if why:
            reason = f"after {losses} lost DP group(s) ({after.cards} cards left): {why}"
    expert_bytes = (m.num_moe_layers + (m.num_nextn_predict_layers if n else 0)) * m.expert_params * inst.weight_bytes
    need = replica_redundant(n, inst.ep, losses)
    replicated, rep_reason = None, None
    groups = inst.ep // inst.tp  # DP groups holding routed experts
    if losses + 1 > groups and n:
        rep_reason = (f"{losses + 1} copies of each expert need {losses + 1} DP groups holding experts; the layout "
                      f"has {groups}")
    elif n:
        rinst = replace(inst, redundant_experts=need)
        replicated = decode_memory(m, hw, rinst, wl)
        rep_reason = refusal_reason(m, hw, rinst, replicated)
    node_experts = min(n, min(k, inst.ep) * slots)  # slots count: replicas on one node make it an upper bound
    return SurvivalReport(
        losses=losses, lost_cards=lost, survivors=alive,
        slots_before=slots, slots_after=(n + red_after) // alive if alive and n else 0,
        redundant_after=red_after, healthy=healthy, degraded=degraded,
        healthy_sequences=healthy.max_batch * inst.dp,
        degraded_sequences=degraded.max_batch * after.dp if degraded and not reason else 0,
        redundant_have=inst.redundant_experts, redundant_needed=need, replicated=replicated,
        replicated_reason=rep_reason, host_copy_card=slots * expert_bytes, host_copy_node=node_experts * expert_bytes,
        cards_per_node=k, reason=reason, node_given=cards_per_node is not None)
