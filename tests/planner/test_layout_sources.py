"""The published rows' layouts against their source (issue 41: "how the A2 decode and prefill deployments in
data/published.yaml are laid out versus the source").

Source of the A2 shapes: Huawei's Omni-Infer template for the published 1P1D Atlas 800I A2 run,
omni-ai-npu/omni-infer tools/omni_cli/template/cli_ds_r1_w8a8c16_a2_1p1d_720tps.yaml (hardware.md "The
published Atlas 800I A2 deployment's layout"). Its figures, as the template states them:
- decode: 4 hosts (d0..d3) x 8 devices, num-dp 32, tp 1, max-num-seqs 60, enable-mtp,
  MODEL_LEN_MAX_DECODE 4096, VLLM_ENABLE_MC2 0 (not CANN's fused MC2 dispatch / combine);
- prefill: 2 hosts (p0, p1) x 8 devices, tp 16, num-dp 1, max-num-seqs 8, max-num-batched-tokens 16896,
  MODEL_LEN_MAX_PREFILL 2064, enable-mtp, enforce-eager (no graph mode; docs/planner.md "Layouts against
  their source").
"""
from moeserve.perf.deploy import Instance
from moeserve.planner import cases

TEMPLATE_DECODE = {"hosts": 4, "devices": 8, "num_dp": 32, "tp": 1, "max_num_seqs": 60, "max_model_len": 4096}
TEMPLATE_PREFILL = {"hosts": 2, "devices": 8, "num_dp": 1, "tp": 16, "max_num_seqs": 8,
                    "max_num_batched_tokens": 16896, "max_model_len": 2064}


def _rows():
    return {c["id"]: c for c in cases.builtin()["cases"]}


def test_a2_decode_layout_is_the_templates():
    t = TEMPLATE_DECODE
    for rid in ("a2-decode-2k2k", "a2-decode-1k2k"):
        c = _rows()[rid]
        inst = Instance(**c["instance"])
        assert c["hardware"] == "atlas-800i-a2"
        assert inst.cards == t["hosts"] * t["devices"] == t["num_dp"] * t["tp"]  # 32 DP ranks, one per card
        assert inst.tp == t["tp"] and inst.max_num_seqs == t["max_num_seqs"]
        assert inst.mtp_drafts == 1 and inst.mtp_acceptance == 0.7  # enable-mtp; brief: normalised to 70%
        w = c["workload"]
        assert w["input_len"] + w["output_len"] <= t["max_model_len"]  # 2K+2K and 1K+2K fit the decode window
        # MC2 off: the MoE runs HCCL allgather / reduce-scatter (hw.md), the planner's allgather mode
        assert inst.moe_comm == "allgather"


def test_a2_prefill_layout_is_the_templates():
    t = TEMPLATE_PREFILL
    for rid in ("a2-prefill-ttft", "a2-prefill-throughput"):
        c = _rows()[rid]
        inst = Instance(**c["instance"])
        assert inst.cards == t["hosts"] * t["devices"] == t["num_dp"] * t["tp"]  # TP16 over both nodes, dp 1
        assert inst.tp == t["tp"] and inst.mtp_drafts == 1
        assert c["requests"] == t["max_num_seqs"]
        # the 8 x 2K prompts are one batch: within max-num-batched-tokens, each within the prefill window
        assert c["requests"] * c["input_len"] <= t["max_num_batched_tokens"]
        assert c["input_len"] <= t["max_model_len"]


def test_a2_prefill_published_figures_are_one_measurement():
    """1622 tok/s per card is the 631 ms for 8 x 2K on 16 cards (system-brief): 16384 / (16 x 0.631 s)."""
    rows = _rows()
    ttft, tput = rows["a2-prefill-ttft"], rows["a2-prefill-throughput"]
    tokens = ttft["requests"] * ttft["input_len"]
    per_card = tokens / (ttft["instance"]["cards"] * ttft["published"]["value"] / 1000)
    assert abs(per_card - tput["published"]["value"]) < 1.0


def test_cloudmatrix_row_counts_dies_and_publishes_per_die():
    """The brief's 144 decode cards are 910C chips (packages of two dies): 288 ranks, of which 256 hold one
    routed expert each (128 cards) and 32 the shared expert (16 cards); the headline 1920 tok/s per card is
    per chip (xDeepServe: "tokens/s per Ascend 910C chip"; Huawei Cloud: 1920 -> 2400 TPS per chip), so
    960 per die, the unit the model predicts in. The paper's per-layer times are at 96 per NPU = 48 per die."""
    table = cases.builtin()
    c = {x["id"]: x for x in table["cases"]}["cloudmatrix384-decode"]
    inst = Instance(**c["instance"])
    assert c["hardware"] == "cloudmatrix-384-die"
    dies_per_card = 2
    assert inst.cards == 144 * dies_per_card and inst.shared_expert_ranks == 16 * dies_per_card
    assert inst.cards - inst.shared_expert_ranks == 256          # one routed expert per die
    assert c["published"]["value"] * dies_per_card == 1920
    assert {p["batch"] for p in table["per_layer"]} == {96 // dies_per_card}
