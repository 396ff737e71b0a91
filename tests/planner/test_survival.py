"""`plan memory --elastic-ep-losses N`: what a layout holds after N lost DP groups (moeserve --enable-elastic-ep),
and what refills the lost experts. Hand-computed on DeepSeek-V3 (256 routed experts, 58 MoE layers + the MTP
layer, A8W8: one byte per expert weight)."""
import json

import pytest

from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.planner.analysis import decode_memory
from moeserve.planner.cli import main
from moeserve.planner.memory import replica_redundant, survival_report, survivor_redundant

V3 = load_model("deepseek-v3")
H800 = load_hardware("hgx-h800")
LAYERS = 58 + 1  # MoE layers + the MTP layer's


def run(capsys, *argv):
    try:
        code = main(["plan", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("ep,redundant,losses,want", [
    (32, 0, 1, (31, 23)),    # 256 + 23 = 279 = 9 x 31
    (32, 0, 2, (30, 14)),    # from the start-up 256 (not the first epoch's 279): 256 + 14 = 270 = 9 x 30
    (64, 0, 1, (63, 59)),    # 315 = 5 x 63
    (64, 0, 2, (62, 54)),    # 256 % 62 = 8, + 54 -> 310 = 5 x 62 (from the first epoch's 315 it would be 6 x 62)
    (32, 32, 1, (31, 54)),   # 288 % 31 = 9, + 22 -> 310 = 10 x 31
    (32, 256, 1, (31, 271)),  # 512 % 31 = 16, + 15 -> 527 = 17 x 31
])
def test_survivor_slots_hand_computed(ep, redundant, losses, want):
    assert survivor_redundant(256, redundant, ep, losses) == want
    assert survivor_redundant(256, redundant, ep, ep)[0] == 0  # nothing left


def test_survivor_slots_follow_the_engine():
    """The planner re-places as the engine does: survivor_parallel applied to the start-up layout (dp_worker's
    base_config) for every epoch's survivors."""
    from moeserve.config import ParallelConfig
    from moeserve.engine.elastic import survivor_parallel
    for ep, red in ((32, 0), (64, 0), (24, 8), (48, 32), (9, 0)):
        base = ParallelConfig(data_parallel_size=ep, enable_expert_parallel=True, num_redundant_experts=red)
        for losses in range(1, 4):
            p = survivor_parallel(base, 256, ep - losses, 1)
            assert survivor_redundant(256, red, ep, losses) == (ep - losses, p.num_redundant_experts)


def test_replica_slots_hand_computed():
    assert replica_redundant(256, 32, 1) == 256   # 512 slots = 16 per card
    assert replica_redundant(256, 64, 2) == 512   # 768 = 12 x 64
    assert replica_redundant(256, 24, 1) == 272   # 512 -> 528 = 22 x 24
    assert replica_redundant(256, 32, 0) == 0
    assert replica_redundant(0, 32, 1) == 0       # a dense model has no experts to replicate


def test_v3_on_32_h800_loses_one_card():
    r = survival_report(V3, H800, Instance(cards=32), Workload(), 1)
    assert (r.survivors, r.slots_before, r.slots_after, r.redundant_after) == (31, 8, 9, 23)
    # the busiest survivor holds 9 routed experts + the shared one in each of 59 layers
    assert r.degraded.detail["experts"] == LAYERS * (9 + 1) * V3.expert_params
    assert r.degraded.weights - r.healthy.weights == pytest.approx(LAYERS * V3.expert_params)
    assert r.degraded.max_batch < r.healthy.max_batch
    assert r.degraded_sequences == r.degraded.max_batch * 31 and r.healthy_sequences == r.healthy.max_batch * 32
    assert not r.carries_load
    # refill from replicas: 256 redundant slots (2 copies of each expert): 16 + 1 experts per card
    assert r.redundant_needed == 256 and not r.replicas_cover
    assert r.replicated.detail["experts"] == LAYERS * (16 + 1) * V3.expert_params
    assert r.replicated_reason is None and r.replicated.max_batch < r.healthy.max_batch
    # else a host copy: a card's 8 experts x 59 layers; a node of 8 cards holds 64 distinct experts
    assert r.host_copy_card == 8 * LAYERS * V3.expert_params
    assert r.host_copy_node == 64 * LAYERS * V3.expert_params
    assert survival_report(V3, H800, Instance(cards=32), Workload(), 1, cards_per_node=4).host_copy_node == \
        32 * LAYERS * V3.expert_params
    assert r.survives and r.refill == "host copy or checkpoint"


def test_v3_on_64_h800_with_and_without_replicas():
    bare = survival_report(V3, H800, Instance(cards=64), Workload(), 1)
    assert (bare.slots_before, bare.slots_after) == (4, 5)
    assert bare.host_copy_card == 4 * LAYERS * V3.expert_params
    assert bare.host_copy_node == 32 * LAYERS * V3.expert_params
    rep = survival_report(V3, H800, Instance(cards=64, redundant_experts=256), Workload(), 1)
    assert rep.replicas_cover and rep.refill == "replicas"
    assert (rep.slots_before, rep.slots_after, rep.redundant_after) == (8, 9, 311)  # 512 -> 567 = 9 x 63
    # a replicated layout's healthy memory is the bare one's "replicated" figure
    assert rep.healthy.weights == bare.replicated.weights
    two = survival_report(V3, H800, Instance(cards=64), Workload(), 2)
    assert (two.slots_after, two.redundant_after, two.redundant_needed) == (5, 54, 512)


def test_one_node_less_is_refused_where_the_survivors_overflow():
    """V3 on 16 Ascend 910B dies: 16 experts per card fit in 57.6 GiB, 18 after a loss do not."""
    hw = load_hardware("910b")
    assert decode_memory(V3, hw, Instance(cards=16), Workload()).max_batch >= 1
    r = survival_report(V3, hw, Instance(cards=16), Workload(), 1)
    assert r.slots_after == 18 and not r.survives and "15 cards left" in r.reason
    assert r.degraded_sequences == 0


def test_tp_loses_a_whole_dp_group():
    r = survival_report(V3, H800, Instance(cards=32, tp=2), Workload(), 1)
    assert (r.lost_cards, r.survivors, r.slots_after) == (2, 30, 9)  # 256 + 14 = 270 = 9 x 30
    assert r.degraded_sequences == r.degraded.max_batch * 15


def test_more_losses_never_fewer_experts_per_card_nor_more_sequences():
    for ep in (8, 9, 16, 24, 32, 48, 64, 96, 144, 256, 320):
        for red in (0, -256 % ep, 32, 256):
            if (256 + red) % ep:
                continue
            prev = (256 + red) // ep
            for losses in range(1, min(ep, 12)):
                alive, r = survivor_redundant(256, red, ep, losses)
                assert (256 + r) % alive == 0
                slots = (256 + r) // alive
                assert slots >= prev and slots >= -(-256 // alive)
                prev = slots
    for cards in (32, 64):
        seqs, slots = [], []
        for losses in range(4):
            r = survival_report(V3, H800, Instance(cards=cards), Workload(), losses)
            seqs.append(r.degraded_sequences)
            slots.append(r.slots_after)
        assert slots == sorted(slots) and seqs == sorted(seqs, reverse=True)


def test_cli_prints_the_survival_and_refuses_naming_the_flag(capsys):
    code, out, _ = run(capsys, "memory", "--hardware", "hgx-h800", "--cards", "32", "--elastic-ep-losses", "1")
    assert code == 0
    assert "8 -> 9 routed experts per card" in out and "--redundant-experts 256" in out
    assert "154.9 GiB per node of 8 cards (the scale-up domain" in out and "survives 1 loss" in out
    code, out, _ = run(capsys, "memory", "--hardware", "910b", "--cards", "16", "--survive-losses", "1", "--json")
    obj = json.loads(out)
    assert code == 1 and obj["refused"].startswith("--elastic-ep-losses 1:")
    assert obj["survival"]["experts_per_card_after"] == 18 and not obj["survival"]["survives"]
    code, out, _ = run(capsys, "memory", "--cards", "32", "--elastic-ep-losses", "32")
    assert code == 1 and "REFUSED (cannot survive): 32 lost DP group(s)" in out and "no routed-expert rank" in out
    code, _, err = run(capsys, "memory", "--elastic-ep-losses", "-1")
    assert code == 2 and "--elastic-ep-losses" in err
    code, _, err = run(capsys, "memory", "--cards-per-node", "0")
    assert code == 2 and "--cards-per-node" in err
    code, out, _ = run(capsys, "memory", "--hardware", "hgx-h800", "--cards", "32", "--json")
    assert code == 0 and "survival" not in json.loads(out)  # default 0: today's report


def test_search_drops_layouts_whose_survivors_do_not_fit():
    from moeserve.planner.search import search
    hw, wl = load_hardware("910b"), Workload()
    plain = search(V3, hw, 48, wl, 100.0, Instance(cards=48))
    res = search(V3, hw, 48, wl, 100.0, Instance(cards=48), survive_losses=1)
    tried, before = res["layouts_tried"]["decode"], plain["layouts_tried"]["decode"]
    assert tried["survive"] > 0 and tried["survive"] + tried["fit"] == before["fit"]
    assert "survival" not in plain["plans"][0]["decode"]
    for plan in res["plans"]:
        lay = plan["decode"]["layout"]
        assert survival_report(V3, hw, Instance(**lay), wl, 1).survives
        assert plan["decode"]["survival"]["losses"] == 1


def test_estimate_reports_and_refuses(capsys):
    code, out, _ = run(capsys, "estimate", "--hardware", "hgx-h800", "--cards", "64", "--elastic-ep-losses", "2",
                       "--json")
    surv = json.loads(out)["survival"]
    assert code == 0 and (surv["experts_per_card_after"], surv["redundant_after"]) == (5, 54)
    code, out, err = run(capsys, "estimate", "--hardware", "910b", "--cards", "16", "--elastic-ep-losses", "1")
    assert code == 1 and "decode instance (16 cards): --elastic-ep-losses 1: after 1 lost DP group(s)" in err
    code, out, _ = run(capsys, "estimate", "--hardware", "hgx-h800", "--cards", "32", "--json")
    assert code == 0 and "survival" not in json.loads(out)
