"""Each cost formula against a hand-computed case on the toy device (tests/planner/helpers.py)."""
import pytest

from moeserve.perf import cost, moe
from moeserve.perf.deploy import Instance
from tests.planner.helpers import TOY_HW as HW, TOY_MODEL as M


def test_gemm_memory_bound_hand_case():
    inst = Instance(cards=1)  # a8w8: 1-byte weights, int8 inputs, bf16 outputs
    op = cost.gemm(HW, inst, "g", tokens=10, params=1e9, n_in=1000, n_out=1000)
    assert op.flops == 2e10
    assert op.nbytes == 1e9 + 10 * (1000 * 1 + 1000 * 2)
    # compute 2e10 / (200e12 * 0.5) = 0.2 ms < memory 1.00003e9 / (1e12 * 0.5) = 2.00006 ms
    assert op.seconds == pytest.approx(2.00006e-3)


def test_gemm_compute_bound_hand_case():
    inst = Instance(cards=1, quantization="bf16")
    op = cost.gemm(HW, inst, "g", tokens=10_000, params=1e6, n_in=10, n_out=10)
    # flops 2e10 / (100e12 * 0.5) = 0.4 ms; bytes 2e6 + 1e4 * 40 = 2.4e6 -> 4.8 us
    assert op.seconds == pytest.approx(4e-4)


def test_mla_decode_hand_case():
    inst = Instance(cards=1)
    op = cost.mla_decode(M, HW, inst, seqs=2, q_per_seq=1, ctx=100)
    assert op.flops == 2 * 2 * 1 * 4 * (2 * 16 + 4) * 100        # 57,600
    assert op.nbytes == 2 * 100 * (16 + 4) * 2                   # 8,000 B of BF16 latent
    assert op.seconds == pytest.approx(8000 / (1e12 * 0.25))     # memory-bound at attention eff
    tp2 = cost.mla_decode(M, HW, Instance(cards=2, tp=2), 2, 1, 100)
    assert tp2.flops == op.flops / 2 and tp2.nbytes == op.nbytes  # TP splits heads, not the latent


def test_attn_prefill_causal_pairs():
    inst = Instance(cards=1)
    op = cost.attn_prefill(M, HW, inst, seqs=1, new=4, past=0)
    assert op.flops == 2 * 4 * (12 + 8) * 10  # 10 causal (q, k) pairs for 4 tokens
    chunk = cost.attn_prefill(M, HW, inst, seqs=1, new=2, past=2)
    assert chunk.flops == 2 * 4 * 20 * (2 * 2 + 3)  # 2 new tokens see 2 cached + 1..2 new
    # BF16 Q, K, V, O (docs/planner.md): K and V of all 4 tokens, Q and O of the 2 new ones only
    assert op.nbytes == 4 * (4 * 12 + 4 * 12 + 4 * 8 + 4 * 8) * 2
    assert chunk.nbytes == 4 * (2 * 12 + 4 * 12 + 4 * 8 + 2 * 8) * 2


def test_lm_head_is_bf16_vocab_parallel():
    op = cost.lm_head(M, HW, Instance(cards=2, tp=2), tokens=3)
    assert op.flops == 2 * 3 * 50 * 64
    assert op.nbytes == 50 * 64 * 2 + 3 * (64 * 2 + 100 * 2)


def test_routed_load_and_active_slots():
    inst = Instance(cards=4)
    copies, active = moe.routed_load(M, inst, n_tokens=64)
    mean = 64 * 2 / 4
    assert copies == pytest.approx(mean * (1 + (2 * __import__("math").log(4) / mean) ** 0.5))
    assert active == pytest.approx(4 * (1 - __import__("math").exp(-64 * 2 / 16)))
    with pytest.raises(ValueError, match="not divisible"):
        moe.routed_load(M, Instance(cards=3), 64)


def test_dedicated_shared_ranks_take_the_slower_kind():
    inst = Instance(cards=5, shared_expert_ranks=1)
    ops = moe.moe_compute(M, HW, inst, q=1000, n_tokens=5000)
    assert [o.name for o in ops][0] == "router" and len(ops) == 2
    shared = moe.expert_gemm(M, HW, inst, "shared_experts", 5000, 1)
    copies, active = moe.routed_load(M, inst, 5000)
    routed = moe.expert_gemm(M, HW, inst, "routed_experts", copies, active)
    assert ops[1].seconds == max(shared.seconds, routed.seconds)


def test_step_adds_mtp_and_overhead():
    from moeserve.perf.step import decode_step
    base = decode_step(M, HW, Instance(cards=1, redundant_experts=0), 8, 100)
    mtp = decode_step(M, HW, Instance(cards=1, mtp_drafts=1), 8, 100)
    assert base.total == pytest.approx(sum(o.seconds for o in base.ops) + 1e-3)
    assert any(o.name.startswith("mtp_") for o in mtp.ops) and mtp.total > base.total
    assert Instance(cards=1, mtp_drafts=1, mtp_acceptance=0.7).tokens_per_step == pytest.approx(1.7)
    assert Instance(cards=1, mtp_drafts=2, mtp_acceptance=0.5).tokens_per_step == pytest.approx(1.75)
