"""--eplb-stats: every layout a command tries gets the imbalance of its own EP size and redundant slots."""
import json

import pytest

from moeserve.planner.cli import main
from moeserve.planner.eplb_stats import LoadSkew, imbalance_from_file


def _skewed(tmp_path):
    """Two layers of Zipf-like loads: the factor depends strongly on the number of EP ranks."""
    layers = {str(layer): [1000.0 / (1 + (e * 7 + layer) % 256) + 1 for e in range(256)] for layer in (3, 4)}
    f = tmp_path / "load.json"
    f.write_text(json.dumps({"format": "moeserve-expert-load", "version": 1, "num_experts": 256, "rank": 0,
                             "world_size": 1, "steps": 1, "layers": layers}))
    return str(f)


def _json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_search_gives_each_layout_its_own_factor(tmp_path, capsys):
    f = _skewed(tmp_path)
    res = _json(capsys, "search", "--hardware", "h20", "--cards", "32", "--tpot-ms", "100", "--top", "50",
                "--eplb-stats", f)
    lays = [c["layout"] for c in res["decode_candidates"] + res["prefill_candidates"]]
    lays += [p[k]["layout"] for p in res["plans"] for k in ("decode", "prefill")]
    assert {l["cards"] for l in lays} >= {16, 32}
    for l in lays:
        want = imbalance_from_file(f, 256, l["cards"] - l["shared_expert_ranks"], l["redundant_experts"])
        assert l["imbalance"] == pytest.approx(want)
    # the --cards 32 value used to be copied to every layout; smaller EP sizes have a smaller max/mean
    assert len({round(l["imbalance"], 6) for l in lays}) > 1


def test_separate_prefill_instance_gets_its_own_factor(tmp_path, capsys):
    f = _skewed(tmp_path)
    obj = _json(capsys, "estimate", "--hardware", "h20", "--cards", "32", "--prefill-cards", "16",
                "--eplb-stats", f)
    assert obj["layout"]["imbalance"] == pytest.approx(imbalance_from_file(f, 256, 32, 0))
    assert obj["prefill_layout"]["imbalance"] == pytest.approx(imbalance_from_file(f, 256, 16, 0))
    assert obj["prefill_layout"]["imbalance"] < obj["layout"]["imbalance"]


def test_factors_are_cached_per_layout(tmp_path):
    skew = LoadSkew.from_files(_skewed(tmp_path), 256)
    assert skew.factor(16, 0) is skew.factor(16, 0) and skew.factor(16, 0) != skew.factor(32, 0)


BAD = {  # file content -> words of the one-line error
    "no_layers": ({"format": "moeserve-expert-load"}, ["'layers'"]),
    "text_load": ([["x"] * 256], ["layer 0, expert 0", "'x'"]),
    "int_layer": ({"format": "moeserve-expert-load", "layers": {"3": 5}}, ["layer 3", "list"]),
    "bad_key": ({"format": "moeserve-expert-load", "layers": {"three": [1] * 256}}, ["'three'"]),
    "negative": ([-1.0] * 256, ["expert 0", "-1.0"]),  # used to give imbalance 1.0 silently
    "all_zero": ([0] * 256, ["no layer records"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_stats_file_names_the_flag_and_the_file(case, tmp_path, capsys):
    data, words = BAD[case]
    f = tmp_path / "load.json"
    f.write_text(json.dumps(data))
    assert main(["plan", "estimate", "--eplb-stats", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--eplb-stats {f}" in err and "Traceback" not in err
    for w in words:
        assert w in err


def test_imbalance_and_eplb_stats_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "estimate", "--imbalance", "1.2", "--eplb-stats", _skewed(tmp_path)])
    assert "--imbalance" in capsys.readouterr().err
