"""Every `plan` subcommand runs and, with --json, prints exactly one JSON object."""
import json

import pytest

from moeserve.planner.cli import main

SMALL = ["--hardware", "atlas-800i-a2", "--cards", "32", "--moe-comm", "allgather", "--mtp-drafts", "1"]
CASES = {
    "estimate": SMALL + ["--batch", "16"],
    "decode": SMALL + ["--tpot-ms", "100"],
    "prefill": ["--hardware", "atlas-800i-a2", "--cards", "16", "--tp", "2", "--requests", "8"],
    "memory": SMALL,
    "search": ["--hardware", "h20", "--cards", "32", "--tpot-ms", "60", "--top", "2"],
    "simulate": ["--model", "deepseek-v2-lite", "--hardware", "h100", "--cards", "1", "--quantization",
                 "bf16", "--num-requests", "40", "--input-len", "64", "--output-len", "16"],
    "validate": [],
    "hardware": [],
}


@pytest.mark.parametrize("cmd", sorted(CASES))
def test_json_is_one_object(cmd, capsys):
    assert main(["plan", cmd, "--json", *CASES[cmd]]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert isinstance(obj, dict) and obj


def test_simulate_pd_reports_both_instances(capsys):
    argv = ["simulate", "--json", "--model", "deepseek-v2-lite", "--hardware", "h100", "--cards", "2",
            "--quantization", "bf16", "--input-len", "256", "--output-len", "16", "--num-requests", "30",
            "--role", "pd", "--prefill-cards", "1", "--prefill-instances", "2"]
    assert main(["plan", *argv]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["role"] == "pd" and obj["cards"] == 4 and obj["decode_instances"] == 1
    assert obj["prefill"]["instances"] == 2 and obj["prefill"]["layout"]["cards"] == 1
    assert obj["ttft_ms"]["p50"] >= obj["analytic_steady_state"]["ttft_ms"] * 0.999  # queueing only adds
    assert main(["plan", "simulate", *argv[2:]]) == 0
    assert "prefill: 2 x 1 cards" in capsys.readouterr().out
    assert main(["plan", *argv, "--sim-dp-groups", "2"]) == 0  # both decode DP groups in lockstep
    obj = json.loads(capsys.readouterr().out)
    assert obj["dp_groups_simulated"] == obj["dp_groups"] == 2 and obj["steady_tok_s_card"] > 0


@pytest.mark.parametrize("cmd", ["estimate", "decode", "hardware"])
def test_text_output(cmd, capsys):
    assert main(["plan", cmd, *CASES[cmd]]) == 0
    assert len(capsys.readouterr().out.splitlines()) > 2


def test_memory_refusal_exit_code_and_reason(capsys):
    assert main(["plan", "memory", "--hardware", "910b", "--cards", "8", "--json"]) == 1
    assert "exceed" in json.loads(capsys.readouterr().out)["refused"]


def test_bad_layout_is_one_error_line(capsys):
    assert main(["plan", "estimate", "--cards", "30", "--redundant-experts", "0"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_decode_plot_png(tmp_path, capsys):
    png = tmp_path / "curve.png"
    assert main(["plan", "decode", *SMALL, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eplb_stats_set_imbalance(tmp_path, capsys):
    loads = [10.0] * 256
    loads[0] = 10.0 * 9  # one hot expert
    f = tmp_path / "eplb.json"
    f.write_text(json.dumps(loads))
    assert main(["plan", "estimate", *SMALL, "--eplb-stats", str(f), "--json"]) == 0
    imb = json.loads(capsys.readouterr().out)["layout"]["imbalance"]
    assert imb == pytest.approx((90 + 7 * 10) / (2640 / 32))  # rank 0 holds experts 0-7; mean 2640/32


@pytest.mark.parametrize("cmd", [None, *sorted(CASES), "profile-cpu"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *([cmd] if cmd else []), "--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


def test_estimate_with_separate_prefill_instance(capsys):
    args = ["plan", "estimate", *SMALL, "--prefill-cards", "16", "--prefill-tp", "2", "--json"]
    assert main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    # The prefill instance keeps the decode layout's MTP drafts: it fills the MTP layer's KV cache.
    assert obj["prefill_layout"]["cards"] == 16
    assert obj["prefill_layout"]["mtp_drafts"] == obj["layout"]["mtp_drafts"]
    d, p = obj["decode"], obj["prefill"]
    ratio = (d["tok_s_card"] * 32 / 2048) / (p["tok_s_card"] * 16 / 2048)
    assert obj["prefill_instances_per_decode_instance"] == pytest.approx(ratio, rel=1e-2)
    # A separate prefill instance: the client's TTFT adds the decode instance's pull of the prompt's KV.
    assert obj["kv_pull_ms"] > 0
    assert obj["ttft_with_kv_pull_ms"] == pytest.approx(p["ttft_ms"] + obj["kv_pull_ms"], abs=1e-2)


def test_search_pairs_smaller_instances_when_the_best_decode_layout_fills_the_cards(capsys):
    # The best decode layouts for 32 H800s use all 32 cards; a 16:16 prefill:decode split must still be found.
    assert main(["plan", "search", "--model", "deepseek-v3", "--hardware", "h800", "--cards", "32", "--tpot-ms", "50",
                 "--input-len", "2048", "--output-len", "2048", "--json"]) in (0, None)
    res = json.loads(capsys.readouterr().out)
    assert res["plans"], "no plan found"
    best = res["plans"][0]
    assert best["cards_used"] <= 32 and best["prefill_instances"] >= 1 and best["decode_instances"] >= 1


def test_overlap_and_flashcomm_flags_reach_the_layout_and_the_breakdown(capsys):
    args = ["plan", "estimate", "--hardware", "atlas-800i-a2", "--cards", "32", "--tp", "2", "--batch", "32",
            "--moe-comm", "allgather", "--flashcomm", "int8", "--weight-prefetch", "--json"]
    assert main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    lay, br = obj["layout"], obj["decode"]["breakdown_ms"]
    assert lay["flashcomm"] == "int8" and lay["weight_prefetch"] and lay["overlap_shared"]
    assert "tp_reduce_scatter" in br and "tp_allgather" in br and "tp_allreduce" not in br
    assert br["weight_prefetch"] < 0 and br["comm_overlap"] < 0
    assert main([*args[:-4], "--no-overlap-shared", "--json"]) == 0
    br = json.loads(capsys.readouterr().out)["decode"]["breakdown_ms"]
    assert "comm_overlap" not in br and "tp_allreduce" in br


def test_bad_flashcomm_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "estimate", "--flashcomm", "fp4"])
    assert "--flashcomm" in capsys.readouterr().err


def test_eplb_stats_from_engine_files_use_the_balanced_placement_of_the_layout(tmp_path, capsys):
    """Two ranks' --expert-load-stats files add up; redundant slots let EPLB split the hot expert."""
    hot = [10.0] * 256
    hot[0] = 10.0 * 17
    files = []
    for r in range(2):
        f = tmp_path / f"load.json.rank{r}"
        f.write_text(json.dumps({"format": "moeserve-expert-load", "version": 1, "num_experts": 256, "rank": r,
                                 "world_size": 2, "steps": 1, "layers": {"3": [x / 2 for x in hot]}}))
        files.append(str(f))

    def imbalance(*extra):
        assert main(["plan", "estimate", *SMALL, "--eplb-stats", *files, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["layout"]["imbalance"]

    mean = sum(hot) / 32
    assert imbalance("--redundant-experts", "0") == pytest.approx((170 + 70) / mean)  # hot expert + 7 others
    # 32 spare slots: the hot expert gets replicas (17 -> ~2 x 8.5) and the packing evens the ranks out
    assert imbalance("--redundant-experts", "32") < 1.1
    assert imbalance("--redundant-experts", "32", "--eplb-placement", "contiguous") == pytest.approx((170 + 70) / mean)


def test_search_simulate_checks_the_best_plan_through_the_pd_simulator(capsys):
    argv = ["plan", "search", "--json", "--model", "deepseek-v2-lite", "--hardware", "h100", "--cards", "16",
            "--quantization", "bf16", "--tpot-ms", "30", "--input-len", "512", "--output-len", "128",
            "--simulate", "1", "--simulate-load", "0.6"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    sim = plan["simulated"]
    assert sim["rate_req_s"] == pytest.approx(0.6 * plan["requests_per_s"], rel=1e-3)
    # what arrives comes out: 60% of the plan's analytic goodput, every request inside the TPOT SLO
    assert sim["steady_tok_s_card"] == pytest.approx(0.6 * plan["goodput_tok_s_card"], rel=0.05)
    assert sim["slo_met_fraction"] == 1.0 and sim["tpot_ms"]["p99"] <= 30
    assert main(argv[:2] + argv[3:]) == 0  # the text report
    assert "simulated at 60%" in capsys.readouterr().out
