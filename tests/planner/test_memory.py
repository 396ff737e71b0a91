import pytest

from moeserve.planner.analysis import decode_memory, prefill_point, require_fits
from moeserve.perf.deploy import Instance, PlanError, Workload
from moeserve.perf.hardware import load_hardware
from moeserve.planner.memory import weights_per_card
from moeserve.perf.models import load_model

V3 = load_model("deepseek-v3")


def test_weights_hand_count_a2_decode():
    inst = Instance(cards=32)
    w = weights_per_card(V3, inst)
    assert w["experts"] == (58 + 1) * (8 + 1) * V3.expert_params  # 58 MoE + MTP layer, 8 routed + shared
    assert w["attention"] == 62 * V3.attn_params                  # INT8: 1 byte each
    assert w["embed_head"] == 2 * V3.embed_params * 2             # BF16
    bf16 = weights_per_card(V3, Instance(cards=32, quantization="bf16"))
    assert bf16["experts"] == 2 * w["experts"]


def test_full_model_on_one_node_of_910b_is_refused_with_reason():
    hw = load_hardware("910b")
    with pytest.raises(PlanError, match=r"weights .* exceed .* usable .*spread experts"):
        require_fits(V3, hw, Instance(cards=8), Workload())


def test_kv_refusal_when_context_too_long():
    hw = load_hardware("h20")
    # 16 experts per card at INT8 leave room for weights but not a 2M-token context
    with pytest.raises(PlanError, match="KV"):
        require_fits(V3, hw, Instance(cards=16), Workload(input_len=2_000_000, output_len=16))


def test_max_batch_is_kv_room_over_per_seq():
    hw = load_hardware("atlas-800i-a2")
    inst = Instance(cards=32, mtp_drafts=1)
    rep = decode_memory(V3, hw, inst, Workload(2048, 2048))
    per_seq = 3072 * (61 + 1) * 576 * 2  # mean context x (layers + MTP) x latent x BF16
    assert rep.kv_per_seq == per_seq
    assert rep.max_batch == int(rep.kv_free // per_seq)
    fp8 = decode_memory(V3, hw, Instance(cards=32, mtp_drafts=1, kv_dtype="int8"), Workload(2048, 2048))
    assert fp8.max_batch >= 2 * rep.max_batch - 1


def test_prefill_refusal_names_the_fix():
    hw = load_hardware("atlas-800i-a2")
    with pytest.raises(PlanError, match="raise attention TP"):
        prefill_point(V3, hw, Instance(cards=16), 8, 2048)
    assert prefill_point(V3, hw, Instance(cards=16, tp=2), 8, 2048).ttft_ms > 0


def test_prefill_workspace_holds_logits_for_sampled_rows_and_gathers_only_real_tokens():
    from moeserve.planner.memory import activation_bytes
    inst = Instance(cards=16, tp=2, moe_comm="allgather")
    # One 2K prompt per DP group: fp32 logits for 2048 rows would be 2048 x 129280 x 4 / 2 (vocab over TP).
    full = activation_bytes(V3, inst, 2048)
    sampled = activation_bytes(V3, inst, 2048, logit_rows=1)
    assert full - sampled == pytest.approx(2047 * 129280 / 2 * 4)
    # 8 prompts on 8 DP groups gather 16K tokens; with only 4 prompts half the groups are idle.
    busy = activation_bytes(V3, inst, 2048, logit_rows=1, n_tokens=8 * 2048)
    half = activation_bytes(V3, inst, 2048, logit_rows=1, n_tokens=4 * 2048)
    assert busy == pytest.approx(sampled)
    assert busy - half == pytest.approx(4 * 2048 * 7168 * 3)   # INT8 inputs + BF16 partial sums


@pytest.mark.parametrize("length", [1, 16, 64, 2048])
def test_max_batch_is_the_largest_batch_that_fits_with_its_own_activations(length):
    """At short contexts a batch's activations outweigh its KV: the max batch must still fit with them
    (and one more must not). A fixed-point iteration oscillated here and refused 1+1 tokens outright."""
    from moeserve.planner.memory import memory_report
    hw, inst, wl = load_hardware("hgx-h800"), Instance(cards=32), Workload(length, length)
    rep = require_fits(V3, hw, inst, wl)
    b = rep.max_batch
    assert memory_report(V3, hw, inst, wl.mean_decode_context, b).max_batch >= b
    assert memory_report(V3, hw, inst, wl.mean_decode_context, b + 1).max_batch < b + 1
    assert rep.weights + rep.activations + b * rep.kv_per_seq <= rep.usable
