"""Assemble per-step costs for decode, prefill and mixed (continuous-batching) steps.

Two-batch overlap (micro_batch_overlap): the step's sequences are split in two halves whose compute and
communication interleave, so the main model costs 2*max(C_half, M_half) + one layer of pipeline fill.
Every half re-reads the weights and pays its own collective floors, which is why overlap loses at small
batch and wins when communication is large next to a compute-bound step; the step is never faster than
serial / (1 + the gain measured on the device family at this many tokens per card), Hardware's tbo_bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeserve.perf import cost, moe
from moeserve.perf.cost import Op, Step
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec


@dataclass(frozen=True)
class Batch:
    """What one DP group runs in a step.

    decode: `decode_seqs` sequences with `decode_new` positions each (1 + MTP drafts) at mean KV length
    `decode_ctx`; prefill: (seqs, new tokens, cached tokens) groups; n_tokens: instance-wide tokens in
    the MoE layers (default: every DP group runs the same).
    """
    decode_seqs: float = 0.0
    decode_new: float = 1.0
    decode_ctx: float = 0.0
    prefill: tuple[tuple[float, float, float], ...] = ()
    n_tokens: float | None = None

    @property
    def q(self) -> float:
        return self.decode_seqs * self.decode_new + sum(s * n for s, n, _ in self.prefill)

    @property
    def head_tokens(self) -> float:
        """Logit rows: every verified decode position, the last position of each prefill."""
        return self.decode_seqs * self.decode_new + sum(s for s, _, _ in self.prefill)

    def scaled(self, f: float) -> "Batch":
        return Batch(self.decode_seqs * f, self.decode_new, self.decode_ctx,
                     tuple((s * f, n, p) for s, n, p in self.prefill),
                     None if self.n_tokens is None else self.n_tokens * f)


def _layer_ops(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch, is_moe: bool,
               overlap: bool = True) -> list[Op]:
    """One decoder layer on the busiest card; `overlap` False under two-batch overlap (which already
    hides communication behind the other micro-batch)."""
    q = b.q
    proj = cost.attn_proj(m, hw, inst, q)
    attn = [proj]
    if b.decode_seqs:
        attn.append(cost.mla_decode(m, hw, inst, b.decode_seqs, b.decode_new, b.decode_ctx + b.decode_new))
    attn += [cost.attn_prefill(m, hw, inst, s, n, p) for s, n, p in b.prefill]
    ops = attn + [cost.elementwise(m, hw, inst, q)] + cost.attn_comm(m, hw, inst, q)
    if is_moe:
        n_tokens = b.n_tokens if b.n_tokens is not None else q * inst.dp
        compute = moe.moe_compute(m, hw, inst, q, n_tokens)
        comm = moe.moe_comm(m, hw, inst, q, n_tokens, prefill=bool(b.prefill) and not b.decode_seqs)
        ops += compute + [moe.moe_permute(m, hw, inst, q, n_tokens)] + comm
        if overlap and inst.overlap_shared:
            ops.append(_shared_overlap(inst, compute, comm))
    else:
        ops += [cost.dense_mlp(m, hw, inst, q)] + cost.tp_allreduce(m, hw, inst, q, inst.mlp_tp,
                                                                    q * inst.mlp_tp / inst.tp)
    if overlap and inst.weight_prefetch:
        ops.append(_weight_prefetch(hw, proj, attn, ops))
    return ops


def _weight_prefetch(hw: Hardware, proj: Op, attn: list[Op], ops: list[Op]) -> Op:
    """Attention weights fetched while the layer's collectives keep the network busy (negative seconds).

    Only the projections' weight reads beyond their FLOPs can be hidden, only within the communication
    window other overlapped work (shared experts) left, and by no more than the published gain of the
    technique (system-brief item 8: +10% MLA, i.e. the attention block takes 1/1.1 of its time), from
    hardware.yaml `prefetch_attention_gain`.
    """
    window = sum(o.seconds for o in ops if o.kind in ("comm", "overlap"))
    gain = hw.eff.prefetch_attention_gain
    cap = (1.0 - 1.0 / (1.0 + gain)) * sum(o.seconds for o in attn)
    return Op("weight_prefetch", -min(window, proj.prefetchable, cap), "overlap")


def _shared_overlap(inst: Instance, compute: list[Op], comm: list[Op]) -> Op:
    """Work independent of the first MoE collective runs while it is in flight (negative seconds).

    Local shared experts need only the layer input; with allgather the gate does not feed the gather
    either (system-brief item 8: gate overlapped with the AllGather, shared expert on a side stream;
    moeserve's dispatchers launch the collective async and run the shared experts meanwhile). With
    dedicated shared-expert ranks those run elsewhere already.
    """
    names = {"shared_experts"} | ({"router"} if inst.moe_comm == "allgather" else set())
    independent = 0.0 if inst.shared_expert_ranks else sum(o.seconds for o in compute if o.name in names)
    first = comm[0].seconds if comm else 0.0
    return Op("comm_overlap", -min(independent, first), "overlap")


def _main_model(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch, overlap: bool = True) -> Step:
    step = Step()
    for op in _layer_ops(m, hw, inst, b, is_moe=False, overlap=overlap):
        step.add(op, m.num_dense_layers)
    if m.num_moe_layers:
        for op in _layer_ops(m, hw, inst, b, is_moe=True, overlap=overlap):
            step.add(op, m.num_moe_layers)
    step.add(cost.lm_head(m, hw, inst, b.head_tokens))
    return step


def _sm_share(hw: Hardware, inst: Instance, b: Batch) -> float:
    """Share of the SMs the overlapped collectives take from compute: DeepEP's normal (prefill) kernels
    hold a fixed SM count while they run; its low-latency (decode) kernels hold SMs only to send and
    receive (SGLang's TBO breakdown: no contention in decode). Under the overlap_bound term."""
    if not hw.eff.has("overlap_bound") or not moe.normal_mode(hw, inst, bool(b.prefill) and not b.decode_seqs):
        return 0.0
    return hw.collective.normal_sm_share


def _overlapped(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> tuple[Step, float]:
    h = _main_model(m, hw, inst, b.scaled(0.5), overlap=False)  # TBO subsumes it
    c, x = h.seconds("compute"), h.seconds("comm")
    step = Step(overlapped=True)
    for op in h.ops:
        step.add(op, 2.0)
    fill = min(c, x) / max(1, m.num_hidden_layers)
    # Compute running beside the other half's collectives gets (1 - s) of the SMs: C + s X, or X when the
    # collectives still outlast it.
    s = _sm_share(hw, inst, b)
    return step, 2.0 * max(c + s * x, x) + fill


def _mtp_draft(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> Step:
    """MTP passes (each: eh_proj + one decoder layer + the shared LM head on each sequence's last row).

    The first pass covers every position the main model ran: all verified decode positions, and the
    whole prompt of a prefill (the MTP layer's own KV cache must hold it, and the first draft needs the
    prompt's last hidden state: a PD prefill instance pays this too). Later passes are one position per
    sequence.
    """
    step = Step()
    seqs = b.decode_seqs + sum(s for s, _, _ in b.prefill)
    for i in range(inst.mtp_drafts):
        new = b.decode_new if i == 0 else 1.0
        prefill = b.prefill if i == 0 else tuple((s, 1.0, p + n + i) for s, n, p in b.prefill)
        q = b.decode_seqs * new + sum(s * n for s, n, _ in prefill)
        sub = Batch(b.decode_seqs, new, b.decode_ctx + b.decode_new + i, prefill,
                    None if b.n_tokens is None else b.n_tokens * q / b.q)
        eh = cost.gemm(hw, inst, "eh_proj", q / inst.tp if inst.seq_parallel else q, 2 * m.hidden_size ** 2,
                       2 * m.hidden_size, m.hidden_size)
        ops = [eh] + _layer_ops(m, hw, inst, sub, is_moe=bool(m.n_routed_experts))
        ops.append(cost.lm_head(m, hw, inst, seqs))
        for op in ops:
            step.add(Op("mtp_" + op.name, op.seconds, op.kind, op.flops, op.nbytes))
    return step


def run_step(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> Step:
    if inst.micro_batch_overlap and b.decode_seqs + sum(s for s, _, _ in b.prefill) >= 2:
        step, total = _overlapped(m, hw, inst, b)
        if hw.eff.has("overlap_bound"):  # no more than the technique's measured gain on this family at this
            serial = sum(o.seconds for o in _main_model(m, hw, inst, b).ops)  # batch (hardware.yaml tbo_gain)
            total = max(total, serial / (1.0 + hw.eff.tbo_bound(b.q / inst.tp)))
    else:
        step = _main_model(m, hw, inst, b)
        total = sum(o.seconds for o in step.ops)  # compute + comm - overlapped (negative) seconds
    if inst.mtp_drafts and b.q:
        draft = _mtp_draft(m, hw, inst, b)
        step.ops += draft.ops
        total += sum(o.seconds for o in draft.ops)
    step.overhead = hw.eff.step_overhead_ms * 1e-3 if hw.eff.has("framework") else 0.0
    step.total = total + step.overhead
    return step


def decode_step(m: ModelSpec, hw: Hardware, inst: Instance, batch: float, context: float) -> Step:
    """One decode step, `batch` sequences per DP group at mean KV length `context`; with MTP each
    sequence verifies 1 + drafts positions."""
    return run_step(m, hw, inst, Batch(batch, 1 + inst.mtp_drafts, context))


def prefill_step(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, length: float,
                 past: float = 0.0, n_tokens: float | None = None) -> Step:
    """One prefill forward: the busiest DP group runs `seqs` x `length` new tokens; `n_tokens` is the
    instance-wide total reaching the MoE layers (default: every DP group equally busy)."""
    return run_step(m, hw, inst, Batch(prefill=((seqs, length, past),), n_tokens=n_tokens))
