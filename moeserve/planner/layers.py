"""Per-layer decode breakdown: one decoder layer on the busiest card, operator by operator, to hold against
published per-layer figures (CloudMatrix: 874 us per layer at batch 96 / 4K KV, 1260 us with MTP;
kernels.md "Framework time per step"), and the step spread over its layers.
"""
from __future__ import annotations

from moeserve.perf import step as steps
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import Hardware
from moeserve.perf.models import ModelSpec


def _us(ops) -> dict[str, float]:
    out: dict[str, float] = {}
    for o in ops:
        out[o.name] = out.get(o.name, 0.0) + o.seconds * 1e6
    return out


def layer_breakdown(m: ModelSpec, hw: Hardware, inst: Instance, batch: float, context: float) -> dict:
    """`batch` sequences per DP group at KV length `context`, each verifying 1 + drafts positions.

    moe_layer_us / dense_layer_us: one layer's operators (negative entries are time hidden by overlap);
    per_layer_us: the whole step (MTP passes, LM head, framework time, two-batch overlap) / layers."""
    b = steps.Batch(batch, 1 + inst.mtp_drafts, context)
    overlap = not inst.micro_batch_overlap
    moe = _us(steps._layer_ops(m, hw, inst, b, is_moe=True, overlap=overlap)) if m.num_moe_layers else {}
    dense = _us(steps._layer_ops(m, hw, inst, b, is_moe=False, overlap=overlap)) if m.num_dense_layers else {}
    st = steps.run_step(m, hw, inst, b)
    layers = m.num_hidden_layers
    mtp = sum(o.seconds for o in st.ops if o.name.startswith("mtp_"))
    return {"batch_per_dp": batch, "context": context, "positions_per_seq": 1 + inst.mtp_drafts,
            "moe_layer_us": {k: round(v, 1) for k, v in sorted(moe.items(), key=lambda kv: -kv[1])},
            "moe_layer_total_us": round(sum(moe.values()), 1),
            "dense_layer_total_us": round(sum(dense.values()), 1),
            "mtp_passes_ms": round(mtp * 1e3, 3), "framework_ms": round(st.overhead * 1e3, 3),
            "step_ms": round(st.total * 1e3, 3), "per_layer_us": round(st.total / layers * 1e6, 1)}


def format_breakdown(res: dict) -> str:
    lines = [f"batch {res['batch_per_dp']:g} per DP group x {res['positions_per_seq']} positions, KV {res['context']:g}:",
             f"  MoE layer {res['moe_layer_total_us']:.0f} us, dense layer {res['dense_layer_total_us']:.0f} us; "
             f"step {res['step_ms']:.2f} ms = {res['per_layer_us']:.0f} us per layer (MTP passes "
             f"{res['mtp_passes_ms']:.2f} ms, framework {res['framework_ms']:.2f} ms)"]
    lines += [f"    {k:<20} {v:>9.1f} us" for k, v in res["moe_layer_us"].items()]
    return "\n".join(lines)
