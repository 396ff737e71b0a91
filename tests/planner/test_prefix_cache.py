"""--prefix-cache-hit-rate: prompt tokens a prefill finds cached are attended to but not computed, in the
analytic prefill, the search's prefill:decode split and the simulator (whose real scheduler runs the engine's
prefix cache over prompts that share their cached part)."""
import json

import pytest

from moeserve.planner import simulate
from moeserve.planner.analysis import prefill_point
from moeserve.planner.cli import main
from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.planner.search import search
from moeserve.planner.sim_report import summarize
from moeserve.perf.step import prefill_step

V3, LITE = load_model("deepseek-v3"), load_model("deepseek-v2-lite")
H800, H100 = load_hardware("h800"), load_hardware("h100", profile="kernel")
PRE = Instance(cards=16, quantization="fp8", moe_comm="alltoall")


def test_cached_tokens_are_attended_to_not_computed():
    wl = Workload(4096, 1024, prefix_hit=0.75)
    assert wl.cached_prompt_tokens == 3072
    pt = prefill_point(V3, H800, PRE, 16, 4096, wl.cached_prompt_tokens)
    # By hand: one prompt per DP group, 1024 new tokens after a 3072-token cached prefix.
    st = prefill_step(V3, H800, PRE, 1, 1024, past=3072, n_tokens=16 * 1024)
    assert pt.ttft_ms == pytest.approx(st.total * 1e3)
    assert pt.tok_s_card == pytest.approx(16 * 4096 / st.total / 16)  # prompt tokens served, cached included
    assert pt.computed_tok_s_card == pytest.approx(pt.tok_s_card / 4)
    d = pt.to_dict()
    assert d["cached_tokens"] == 3072 and d["computed_tok_s_card"] < d["tok_s_card"]


def test_more_hits_never_slow_a_prefill_and_the_last_token_is_computed():
    ttfts = [prefill_point(V3, H800, PRE, 16, 4096, Workload(4096, 1, prefix_hit=h).cached_prompt_tokens).ttft_ms
             for h in (0.0, 0.25, 0.5, 0.9, 0.999999)]
    assert ttfts == sorted(ttfts, reverse=True) and ttfts[-1] < ttfts[0] / 5
    assert Workload(4096, 1, prefix_hit=0.999999).cached_prompt_tokens == 4095
    # Attention still sees the cached prefix: a cached 3K + 1K prompt costs more than a lone 1K prompt.
    assert prefill_point(V3, H800, PRE, 16, 4096, 3072).ttft_ms > prefill_point(V3, H800, PRE, 16, 1024).ttft_ms


def test_search_needs_fewer_prefill_cards_with_hits():
    kw = dict(cards=64, tpot_ms=50.0, base=Instance(cards=8, quantization="fp8", mtp_drafts=1), top=1)
    cold = search(V3, H800, wl=Workload(4096, 512), **kw)["plans"][0]
    warm = search(V3, H800, wl=Workload(4096, 512, prefix_hit=0.8), **kw)["plans"][0]
    assert warm["goodput_tok_s_card"] > cold["goodput_tok_s_card"]
    assert warm["prefill_cards"] / warm["cards_used"] < cold["prefill_cards"] / cold["cards_used"]


def test_simulator_runs_the_engine_prefix_cache():
    inst = Instance(cards=1, quantization="bf16")
    res = {}
    for hit in (0.0, 0.75):
        wl = Workload(1024, 16, prefix_hit=hit)
        raw = simulate.run(LITE, H100, inst, wl, 20.0, 200, arrival="constant")
        res[hit] = (raw["prefix_cache"], summarize(raw, inst, None, None, window=(0.3, 0.9)))
    (q0, h0), cold = res[0.0]
    (q1, h1), warm = res[0.75]
    assert h0 == 0 and q1 == 200 * 1024
    # 768 shared tokens = 48 whole blocks, served from the cache to every request but the first.
    assert h1 == 199 * 768
    assert warm["ttft_ms"]["p50"] < cold["ttft_ms"]["p50"]


def test_cli_flag(capsys):
    code = main(["plan", "prefill", "--model", "deepseek-v3", "--hardware", "h800", "--cards", "16",
                 "--input-len", "4096", "--prefix-cache-hit-rate", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["cached_tokens"] == 2048
    for bad in ("1", "-0.1", "nan"):
        with pytest.raises(SystemExit) as e:
            main(["plan", "prefill", "--prefix-cache-hit-rate", bad])
        assert e.value.code == 2
        assert "--prefix-cache-hit-rate" in capsys.readouterr().err
    code = main(["plan", "simulate", "--model", "deepseek-v2-lite", "--hardware", "h100", "--cards", "1",
                 "--quantization", "bf16", "--input-len", "512", "--output-len", "8", "--num-requests", "50",
                 "--prefix-cache-hit-rate", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and 0.4 < out["prefix_cache_hit_rate"] <= 0.5
