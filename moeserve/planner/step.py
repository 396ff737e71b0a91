"""Assemble per-step costs for decode and prefill from the per-operator models.

Two-batch overlap (micro_batch_overlap): the step's tokens are split in two halves whose compute and
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
class Phase:
    """What one DP group runs this step: `seqs` sequences, `new` tokens each, after `past` cached."""
    seqs: float
    new: float
    past: float
    decode: bool
    n_tokens: float | None = None  # instance-wide tokens in the MoE layers (default: dp * seqs * new)


def _layer_ops(m: ModelSpec, hw: Hardware, inst: Instance, ph: Phase, is_moe: bool) -> list[Op]:
    q = ph.seqs * ph.new
    ops = [cost.attn_proj(m, hw, inst, q), cost.elementwise(m, hw, q)]
    if ph.decode:
        ops.append(cost.mla_decode(m, hw, inst, ph.seqs, ph.new, ph.past + ph.new))
    else:
        ops.append(cost.attn_prefill(m, hw, inst, ph.seqs, ph.new, ph.past))
    ops.append(cost.tp_allreduce(m, hw, inst, q))
    if is_moe:
        n_tokens = ph.n_tokens if ph.n_tokens is not None else q * inst.dp
        ops += moe.moe_compute(m, hw, inst, q, n_tokens) + moe.moe_comm(m, hw, inst, q, n_tokens)
    else:
        ops += [cost.dense_mlp(m, hw, inst, q), cost.tp_allreduce(m, hw, inst, q)]
    return ops


def _main_model(m: ModelSpec, hw: Hardware, inst: Instance, ph: Phase) -> Step:
    """All decoder layers plus the LM head (one position per sequence in prefill, all in decode)."""
    step = Step()
    for op in _layer_ops(m, hw, inst, ph, is_moe=False):
        step.add(op, m.num_dense_layers)
    if m.num_moe_layers:
        for op in _layer_ops(m, hw, inst, ph, is_moe=True):
            step.add(op, m.num_moe_layers)
    head_tokens = ph.seqs * ph.new if ph.decode else ph.seqs
    step.add(cost.lm_head(m, hw, inst, head_tokens))
    return step


def _overlapped(m: ModelSpec, hw: Hardware, inst: Instance, ph: Phase) -> tuple[Step, float]:
    half = Phase(ph.seqs / 2, ph.new, ph.past, ph.decode,
                 None if ph.n_tokens is None else ph.n_tokens / 2)
    h = _main_model(m, hw, inst, half)
    c, x = h.seconds("compute"), h.seconds("comm")
    step = Step(overlapped=True)
    for op in h.ops:
        step.add(op, 2.0)
    fill = min(c, x) / max(1, m.num_hidden_layers)
    return step, 2.0 * max(c, x) + fill


def _mtp_draft(m: ModelSpec, hw: Hardware, inst: Instance, ph: Phase) -> Step:
    """Drafts from the MTP module: the first pass covers all verified positions, later ones one each."""
    step = Step()
    for i in range(inst.mtp_drafts):
        new = ph.new if i == 0 else 1
        sub = Phase(ph.seqs, new, ph.past + ph.new + i, decode=True)
        q = sub.seqs * sub.new
        eh = cost.gemm(hw, inst, "mtp_eh_proj", q, 2 * m.hidden_size ** 2, 2 * m.hidden_size, m.hidden_size)
        for op in [eh] + _layer_ops(m, hw, inst, sub, is_moe=bool(m.n_routed_experts)) + \
                [cost.lm_head(m, hw, inst, ph.seqs)]:
            step.add(Op("mtp_" + op.name.removeprefix("mtp_"), op.seconds, op.kind, op.flops, op.nbytes))
    return step


def run_step(m: ModelSpec, hw: Hardware, inst: Instance, ph: Phase) -> Step:
    if inst.micro_batch_overlap and ph.seqs >= 2:
        step, main = _overlapped(m, hw, inst, ph)
    else:
        step = _main_model(m, hw, inst, ph)
        main = step.seconds("compute") + step.seconds("comm")
    total = main
    if ph.decode and inst.mtp_drafts:
        draft = _mtp_draft(m, hw, inst, ph)
        step.ops += draft.ops
        total += draft.seconds("compute") + draft.seconds("comm")
    step.overhead = hw.eff.step_overhead_ms * 1e-3
    step.total = total + step.overhead
    return step


def decode_step(m: ModelSpec, hw: Hardware, inst: Instance, batch: float, context: float) -> Step:
    """One decode step with `batch` sequences per DP group at mean KV length `context`.

    With MTP, each sequence verifies 1 + drafts positions this step.
    """
    return run_step(m, hw, inst, Phase(batch, 1 + inst.mtp_drafts, context, decode=True))


def prefill_step(m: ModelSpec, hw: Hardware, inst: Instance, seqs: float, length: float,
                 past: float = 0.0, n_tokens: float | None = None) -> Step:
    """One prefill forward: the busiest DP group runs `seqs` x `length` new tokens; `n_tokens` is the
    instance-wide total reaching the MoE layers (default: every DP group equally busy)."""
    return run_step(m, hw, inst, Phase(seqs, length, past, decode=False, n_tokens=n_tokens))
