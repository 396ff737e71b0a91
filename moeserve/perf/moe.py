"""MoE layer costs: router, routed experts on the busiest rank, shared experts, dispatch/combine.

Routing is modelled as uniform over experts (what EPLB with redundant copies aims at) plus sampling noise
(comm.max_load_factor) times the residual skew: Instance.imbalance, or where that is None the model's
published residual under EPLB (ModelSpec.residual_imbalance; none on a single expert rank).
"""
from __future__ import annotations

import math

from moeserve.perf import comm
from moeserve.perf.cost import ACT, Op, gemm, gemm_roofline, roofline
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec


def _scale_bytes(inst: Instance, hidden: int) -> float:
    """Scales riding with a quantised dispatch: one fp32 per token (INT8, per-token dynamic) or one fp32
    per 128-element block (FP8, DeepSeek-V3's 1x128 activation blocks; DeepEP's FP8 dispatch, which FP4
    deployments keep)."""
    if inst.dispatch_bytes >= 2:
        return 0.0
    return 4.0 * math.ceil(hidden / 128) if inst.compute_dtype in ("fp8", "fp4") else 4.0


def residual_skew(m: ModelSpec, inst: Instance) -> float:
    """The busiest expert rank's load over the mean beyond sampling noise: --imbalance (or --eplb-stats) where
    given, else the model's published residual under EPLB; one expert rank has no other to be busier than."""
    if inst.imbalance is not None:
        return inst.imbalance
    return m.residual_imbalance if inst.ep > 1 else 1.0


def routed_load(m: ModelSpec, inst: Instance, n_tokens: float, noise: bool = True) -> tuple[float, float]:
    """(token copies on the busiest routed rank, expert slots with >=1 token on it); `noise` False (the
    kernel profile, no load_noise term): every rank gets the mean."""
    k, experts = m.num_experts_per_tok, m.n_routed_experts
    mean = n_tokens * k / inst.ep
    busiest = mean * comm.max_load_factor(mean, inst.ep) * residual_skew(m, inst) if noise else mean
    slots = inst.expert_slots(experts)
    per_slot = n_tokens * k / (experts + inst.redundant_experts)
    active = slots * (1.0 - math.exp(-per_slot))  # P(a slot gets no token) ~ exp(-mean per slot)
    return busiest, active


def expert_gemm(m: ModelSpec, hw: Hardware, inst: Instance, name: str, copies: float,
                weights_read: float) -> Op:
    """Grouped gate_up + SiLU*mul + down over `copies` token copies; `weights_read` experts streamed."""
    h, i = m.hidden_size, m.moe_intermediate_size
    a_in = inst.act_in_bytes
    act = copies * (h * a_in + 2 * i * ACT + 2 * i * ACT + i * (ACT + a_in) + h * ACT)
    nbytes = weights_read * m.expert_params * inst.weight_bytes + act
    return gemm_roofline(hw, name, 2.0 * copies * m.expert_params, nbytes, inst.compute_dtype)


def moe_compute(m: ModelSpec, hw: Hardware, inst: Instance, q: float, n_tokens: float) -> list[Op]:
    """Compute ops of one MoE layer on the busiest card (routed rank or dedicated shared rank)."""
    # With sequence parallelism each TP rank routes only its own token shard.
    own = q / inst.tp if inst.seq_parallel else q
    ops = [gemm(hw, inst, "router", own, m.gate_params, m.hidden_size, m.n_routed_experts,
                dtype="bf16", wbytes=ACT)]
    copies, active = routed_load(m, inst, n_tokens, hw.eff.has("load_noise"))
    routed = expert_gemm(m, hw, inst, "routed_experts", copies, active)
    ns = m.n_shared_experts
    if ns and inst.shared_expert_ranks:
        shared = expert_gemm(m, hw, inst, "shared_experts", n_tokens * ns / inst.shared_expert_ranks, ns)
        # Routed and shared ranks work in parallel: the layer waits for the slower kind.
        ops.append(routed if routed.seconds >= shared.seconds else shared)
    else:
        ops.append(routed)
        if ns:
            ops.append(expert_gemm(m, hw, inst, "shared_experts", q / inst.tp * ns, ns))
    return ops


def moe_permute(m: ModelSpec, hw: Hardware, inst: Instance, q: float, n_tokens: float) -> Op:
    """Memory traffic around the expert GEMMs that neither the GEMMs nor the collectives do.

    alltoall: the origin sums its k (+1) returned BF16 copies per token into the hidden state.
    allgather: every card writes a full [N, H] BF16 output buffer (its experts' weighted rows
    scattered in, zeros elsewhere) for the reduce-scatter, after reading its copies' outputs.
    """
    h = m.hidden_size
    if inst.moe_comm == "allgather":
        copies, _ = routed_load(m, inst, n_tokens, hw.eff.has("load_noise"))
        nbytes = (copies + n_tokens) * h * ACT
    else:
        tokens = q / inst.tp
        nbytes = tokens * (m.num_experts_per_tok + (1 if inst.shared_expert_ranks else 0) + 1) * h * ACT
    return roofline(hw, "moe_permute", 0.0, nbytes, "bf16")


def nodes_per_token(m: ModelSpec, nodes: int) -> float:
    """Expected distinct nodes (own included) a token's top-k experts sit on, experts placed contiguously
    (EP ranks hold consecutive experts, nodes consecutive ranks, so a node holds whole groups when there are
    no more nodes than groups). Group-limited routing (DeepSeek-V3: top-4 of 8 groups): a node holding `per`
    groups is missed with the hypergeometric probability C(G - per, t) / C(G, t), every chosen group taken
    to hold at least one of the token's experts; more nodes than groups: k experts spread over the t chosen
    groups' nodes. Without groups: k experts spread uniformly over the nodes."""
    k = m.num_experts_per_tok
    if nodes <= 1:
        return 1.0
    g, t = m.n_group, m.topk_group
    if t < g and nodes <= g:
        per, missed = g / nodes, 1.0
        for i in range(t):
            missed *= max(0.0, (g - per - i) / (g - i))
        return nodes * (1.0 - missed)
    span = t * nodes / g if t < g else nodes
    return min(nodes, span * (1.0 - (1.0 - 1.0 / span) ** k))


def normal_mode(hw: Hardware, inst: Instance, prefill: bool) -> bool:
    """Whether a step's all-to-all runs DeepEP's normal mode: prompts only, a fabric with normal-mode
    figures, and no dedicated shared-expert ranks (not what those figures measured)."""
    return (prefill and inst.moe_comm == "alltoall" and inst.cards > 1 and not inst.shared_expert_ranks
            and comm.normal_rate(hw, inst.cards, "dispatch") is not None)


def _normal_comm(m: ModelSpec, hw: Hardware, inst: Instance, q: float, n_tokens: float,
                 d_bytes: float) -> list[Op]:
    """Prefill's DeepEP normal-mode dispatch / combine (comm.normal_alltoall)."""
    k, ep = m.num_experts_per_tok, inst.ep
    domain = min(hw.scale_up_domain, inst.cards)
    nodes = -(-inst.cards // domain)
    send = q / inst.tp
    copies, _ = routed_load(m, inst, n_tokens, hw.eff.has("load_noise"))
    ranks_per_token = ep * (1.0 - (1.0 - 1.0 / ep) ** k)  # DeepEP sends a token once per card
    recv = copies * ranks_per_token / k
    per_node = nodes_per_token(m, nodes)
    return [Op("dispatch", comm.normal_alltoall(hw, inst.cards, send, per_node, recv, d_bytes, "dispatch"), "comm"),
            Op("combine", comm.normal_alltoall(hw, inst.cards, send, per_node, recv, m.hidden_size * ACT,
                                               "combine"), "comm")]


def moe_comm(m: ModelSpec, hw: Hardware, inst: Instance, q: float, n_tokens: float,
             prefill: bool = False) -> list[Op]:
    """Dispatch + combine (all-to-all) or allgather + reduce-scatter, per MoE layer. `prefill`: a step of
    prompts only, whose all-to-all runs DeepEP's normal mode where the fabric has its figures."""
    h, cards = m.hidden_size, inst.cards
    d_bytes = h * inst.dispatch_bytes + _scale_bytes(inst, h)
    if inst.moe_comm == "allgather":
        return [Op("allgather", comm.moe_gather(hw, cards, n_tokens * d_bytes, "dispatch"), "comm"),
                Op("reduce_scatter", comm.moe_gather(hw, cards, n_tokens * h * ACT, "combine"), "comm")]
    if normal_mode(hw, inst, prefill):
        return _normal_comm(m, hw, inst, q, n_tokens, d_bytes)
    send = q / inst.tp * (m.num_experts_per_tok + (1 if inst.shared_expert_ranks else 0))
    recv, _ = routed_load(m, inst, n_tokens, hw.eff.has("load_noise"))
    if inst.shared_expert_ranks:
        recv = max(recv, n_tokens / inst.shared_expert_ranks)
    copies = max(send, recv)  # the busiest card's link decides
    return [Op("dispatch", comm.alltoall(hw, cards, copies, d_bytes, "dispatch"), "comm"),
            Op("combine", comm.alltoall(hw, cards, copies, h * ACT, "combine"), "comm")]
