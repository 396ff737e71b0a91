"""Assemble per-step costs for decode, prefill and mixed (continuous-batching) steps.

Two-batch overlap (micro_batch_overlap): the step's sequences are split in two halves whose compute and
communication interleave, so the main model costs 2*max(C_half, M_half) + one layer of pipeline fill.
Every half re-reads the weights, which is why overlap loses at small batch (hardware.md: -27% at 32
tokens/device) and wins when communication is large next to a compute-bound step (+25-35%).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeserve.planner import cost, moe
from moeserve.planner.cost import Op, Step
from moeserve.planner.deploy import Instance
from moeserve.planner.hardware import Hardware
from moeserve.planner.models import ModelSpec


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


def _layer_ops(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch, is_moe: bool) -> list[Op]:
    q = b.q
    ops = [cost.attn_proj(m, hw, inst, q), cost.elementwise(m, hw, q)]
    if b.decode_seqs:
        ops.append(cost.mla_decode(m, hw, inst, b.decode_seqs, b.decode_new, b.decode_ctx + b.decode_new))
    ops += [cost.attn_prefill(m, hw, inst, s, n, p) for s, n, p in b.prefill]
    ops.append(cost.tp_allreduce(m, hw, inst, q))
    if is_moe:
        n_tokens = b.n_tokens if b.n_tokens is not None else q * inst.dp
        ops += moe.moe_compute(m, hw, inst, q, n_tokens) + moe.moe_comm(m, hw, inst, q, n_tokens)
    else:
        ops += [cost.dense_mlp(m, hw, inst, q), cost.tp_allreduce(m, hw, inst, q)]
    return ops


def _main_model(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> Step:
    step = Step()
    for op in _layer_ops(m, hw, inst, b, is_moe=False):
        step.add(op, m.num_dense_layers)
    if m.num_moe_layers:
        for op in _layer_ops(m, hw, inst, b, is_moe=True):
            step.add(op, m.num_moe_layers)
    step.add(cost.lm_head(m, hw, inst, b.head_tokens))
    return step


def _overlapped(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> tuple[Step, float]:
    h = _main_model(m, hw, inst, b.scaled(0.5))
    c, x = h.seconds("compute"), h.seconds("comm")
    step = Step(overlapped=True)
    for op in h.ops:
        step.add(op, 2.0)
    fill = min(c, x) / max(1, m.num_hidden_layers)
    return step, 2.0 * max(c, x) + fill


def _mtp_draft(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> Step:
    """MTP drafts for the decode sequences: the first pass covers every verified position, later ones
    one position each (each pass: eh_proj + one decoder layer + the shared LM head)."""
    step = Step()
    for i in range(inst.mtp_drafts):
        new = b.decode_new if i == 0 else 1.0
        sub = Batch(b.decode_seqs, new, b.decode_ctx + b.decode_new + i)
        q = sub.q
        eh = cost.gemm(hw, inst, "eh_proj", q, 2 * m.hidden_size ** 2, 2 * m.hidden_size, m.hidden_size)
        ops = [eh] + _layer_ops(m, hw, inst, sub, is_moe=bool(m.n_routed_experts))
        ops.append(cost.lm_head(m, hw, inst, b.decode_seqs))
        for op in ops:
            step.add(Op("mtp_" + op.name, op.seconds, op.kind, op.flops, op.nbytes))
    return step


def run_step(m: ModelSpec, hw: Hardware, inst: Instance, b: Batch) -> Step:
    if inst.micro_batch_overlap and b.decode_seqs + sum(s for s, _, _ in b.prefill) >= 2:
        step, total = _overlapped(m, hw, inst, b)
    else:
        step = _main_model(m, hw, inst, b)
        total = step.seconds("compute") + step.seconds("comm")
    if b.decode_seqs and inst.mtp_drafts:
        draft = _mtp_draft(m, hw, inst, b)
        step.ops += draft.ops
        total += draft.seconds("compute") + draft.seconds("comm")
    step.overhead = hw.eff.step_overhead_ms * 1e-3
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
