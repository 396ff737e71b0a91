import pytest

from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.planner.search import search, split, Candidate

V3 = load_model("deepseek-v3")


def test_search_ranks_by_goodput_and_respects_slo_and_cards():
    hw = load_hardware("h20")
    res = search(V3, hw, 64, Workload(2048, 1024), 60.0, Instance(cards=8, mtp_drafts=1), top=4)
    plans = res["plans"]
    assert plans, "some layout must fit 64 H20s"
    good = [p["goodput_tok_s_card"] for p in plans]
    assert good == sorted(good, reverse=True)
    for p in plans:
        assert p["cards_used"] <= 64 and p["decode"]["latency_ms"] <= 60.0
        assert p["prefill_cards"] + p["decode_cards"] == p["cards_used"]


def test_no_plan_when_nothing_fits():
    res = search(V3, load_hardware("910b"), 8, Workload(), 50.0, Instance(cards=8))
    assert res["plans"] == []


def test_split_balances_prefill_and_decode():
    wl = Workload(1000, 1000)
    dec = Candidate("decode", Instance(cards=8), tok_s_card=1000.0, latency_ms=50, batch=10)
    pre = Candidate("prefill", Instance(cards=8), tok_s_card=3000.0, latency_ms=100, batch=1)
    s = split(64, dec, pre, wl)
    # 1 prefill instance (24 req/s) feeds 3 decode instances (8 req/s each): 32 cards, 750 tok/s/card
    assert (s["prefill_instances"], s["decode_instances"]) == (1, 3)
    assert s["goodput_tok_s_card"] == 750.0



def test_split_may_leave_decode_headroom_when_that_gives_more_per_card():
    """Balance at 1.1 prefill instances per decode instance: 1 prefill instance (prefill-bound) beats 2
    (decode-bound with a mostly idle second prefill instance) per card."""
    wl = Workload(1000, 1000)
    dec = Candidate("decode", Instance(cards=32), tok_s_card=1100 / 32 * 1000 / 1000, latency_ms=50, batch=10)
    pre = Candidate("prefill", Instance(cards=16), tok_s_card=1000 / 16, latency_ms=100, batch=1)
    # one decode instance finishes 1.1 req/s, one prefill instance starts 1.0 req/s
    s = split(64, dec, pre, wl)
    assert (s["prefill_instances"], s["decode_instances"]) == (1, 1)
    assert s["goodput_tok_s_card"] == round(1.0 * 1000 / 48, 1)  # not 1.1 x 1000 / 64 with 2 prefill instances
    best = max(min(nd * 1.1, n_pre * 1.0) * 1000 / (32 * nd + 16 * n_pre)
               for nd in (1, 2) for n_pre in range(1, (64 - 32 * nd) // 16 + 1))
    assert s["goodput_tok_s_card"] == round(best, 1)

def test_kv_pull_counts_against_the_ttft_slo():
    # A2: 8 cards per HCCS node, so a 48-card deployment pulls KV over RoCE; 8K prompts of DeepSeek-V3
    # with the MTP layer are 8192 x 70272 x 62/61 B = 585 MB -> ~25 ms at 25 GB/s x 0.95, + 1.5 us.
    from moeserve.planner.analysis import kv_pull_ms
    hw = load_hardware("atlas-800i-a2")
    base = Instance(cards=8, quantization="a8w8", mtp_drafts=1, moe_comm="allgather")
    pull = kv_pull_ms(V3, hw, base, 8192, 48)
    assert pull == pytest.approx(8192 * 70272 * 62 / 61 / (25e9 * 0.95) * 1e3 + 0.0015, rel=1e-3)
    assert kv_pull_ms(V3, hw, base, 8192, 8) < pull / 5   # one node: over HCCS
    free = search(V3, hw, 48, Workload(8192, 512), 100.0, base, top=50)
    assert free["kv_pull_ms"] == pytest.approx(pull, abs=1e-3)
    ttfts = sorted(p["prefill"]["latency_ms"] for p in free["plans"])
    # An SLO between a plan's prefill TTFT and its TTFT with the pull must drop that plan.
    slo = ttfts[0] + pull / 2
    tight = search(V3, hw, 48, Workload(8192, 512), 100.0, base, ttft_ms=slo, top=50)
    assert tight["plans"], "smaller prefill batches still meet the SLO"
    for p in tight["plans"]:
        assert p["ttft_with_kv_pull_ms"] <= slo
        assert p["ttft_with_kv_pull_ms"] == pytest.approx(p["prefill"]["latency_ms"] + pull, abs=0.01)


@pytest.mark.parametrize("argv,words", [
    # 8 H800s hold no decode layout of V3 (weights alone exceed the 72 GiB usable per card)
    (["--cards", "8", "--tpot-ms", "5", "--ttft-ms", "10"], ["no decode layout", "28 do not fit in memory"]),
    (["--hardware", "hgx-h200", "--cards", "16", "--tpot-ms", "1"], ["no decode layout", "miss the TPOT SLO"]),
    (["--hardware", "hgx-h200", "--cards", "16", "--ttft-ms", "1"], ["no prefill layout", "miss the TTFT SLO"]),
    (["--hardware", "hgx-h200", "--cards", "8"], ["no prefill + decode pair fits in 8 cards", "--cards >= 16"]),
])
def test_search_without_a_plan_says_why(argv, words, capsys):
    import json
    from moeserve.planner.cli import main
    assert main(["plan", "search", *argv, "--json"]) == 1  # refused: no plan
    res = json.loads(capsys.readouterr().out)
    assert res["plans"] == []
    for w in words:
        assert w in res["refused"]
    tried = res["layouts_tried"]["decode"]
    assert sum(tried.values()) > 0
    assert main(["plan", "search", *argv]) == 1
    assert words[0] in capsys.readouterr().out


def test_search_counts_the_layouts_it_tried():
    from moeserve.planner.search import decode_layouts
    hw = load_hardware("hgx-h200")
    res = search(V3, hw, 16, Workload(), 50.0, Instance(cards=16))
    assert res["plans"] and "refused" not in res
    tried = res["layouts_tried"]["decode"]
    assert sum(tried.values()) == len(list(decode_layouts(V3, hw, 16, Instance(cards=16))))
    assert tried["fit"] >= 1
