"""Expert-load statistics (--expert-load-stats), the EPLB placement and `moeserve eplb`."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from moeserve import LLM, SamplingParams
from moeserve.cli import main
from moeserve.config import ParallelConfig
from moeserve.layers.moe.eplb import imbalance, rebalance, replica_counts
from moeserve.layers.moe.load_stats import read_loads
from moeserve.layers.moe.placement import build_plan, default_map
from moeserve.arch import DeepseekArch

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61))]
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 3), st.data())
def test_rebalance_is_a_valid_map_within_one_replica_of_the_mean(ranks, per_rank, extra_per_rank, data):
    n, red = ranks * per_rank, ranks * extra_per_rank
    loads = data.draw(st.lists(st.floats(0, 1000), min_size=n, max_size=n))
    phys = rebalance(loads, red, ranks)
    assert len(phys) == n + red and set(phys) == set(range(n))  # every expert has a slot
    reps = replica_counts(loads, red)
    assert [phys.count(e) for e in range(n)] == reps
    s = (n + red) // ranks
    for r in range(ranks):  # replicas of one expert sit on different ranks when they can
        block = phys[r * s:(r + 1) * s]
        assert len(block) == len(set(block)) or max(reps) > ranks
    if sum(loads) > 0:
        best = imbalance(phys, loads, ranks)
        # greedy packing: the busiest rank exceeds the mean by at most one replica's load
        biggest = max(loads[e] / reps[e] for e in range(n))
        mean = sum(loads) / ranks
        assert best * mean <= mean + biggest + 1e-6


def test_hot_experts_get_the_redundant_slots():
    loads = [100.0, 10, 10, 10, 10, 10, 10, 40]
    assert replica_counts(loads, 4) == [4, 1, 1, 1, 1, 1, 1, 2]
    phys = rebalance(loads, 4, 4)  # 12 slots, 3 per rank
    assert imbalance(phys, loads, 4) == pytest.approx(1.0, abs=0.2)
    assert imbalance(default_map(8, 4, 4), loads, 4) > 1.5


def test_recording_counts_every_routed_pair_and_changes_no_output(ckpt_dir, tmp_path):
    path = ckpt_dir("v3")
    ref = LLM(path, dtype="float32").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    stats = tmp_path / "load.json"
    out = LLM(path, dtype="float32", expert_load_stats=str(stats)).generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    data = json.loads(stats.read_text())
    arch = DeepseekArch.from_pretrained(path)
    moe_layers = [i for i in range(arch.num_hidden_layers) if arch.is_moe_layer(i)]
    assert data["format"] == "moeserve-expert-load" and sorted(map(int, data["layers"])) == moe_layers
    # every position the model ran (prompts + fed-back tokens) routes to top-k experts in every MoE layer
    positions = sum(len(p) + NEW - 1 for p in PROMPTS)
    for counts in data["layers"].values():
        assert len(counts) == arch.n_routed_experts and sum(counts) == positions * arch.num_experts_per_tok


def test_dp_ranks_write_files_that_add_up_to_the_single_process_counts(ckpt_dir, tmp_path):
    path = ckpt_dir("v3")
    single, multi = tmp_path / "one.json", tmp_path / "dp.json"
    LLM(path, dtype="float32", expert_load_stats=str(single)).generate(prompt_token_ids=PROMPTS,
                                                                     sampling_params=GREEDY)
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              expert_load_stats=str(multi), distributed_timeout=30)
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm.shutdown()  # ranks write their final counts on the way out
    files = [f"{multi}.rank0", f"{multi}.rank1"]
    assert read_loads(files) == read_loads([str(single)])


def test_eplb_cli_writes_a_placement_the_engine_accepts(ckpt_dir, tmp_path, capsys):
    path = ckpt_dir("v3")
    stats = tmp_path / "load.json"
    LLM(path, dtype="float32", expert_load_stats=str(stats)).generate(prompt_token_ids=PROMPTS,
                                                                    sampling_params=GREEDY)
    out = tmp_path / "placement.json"
    assert main(["eplb", str(stats), "--ep-size", "2", "--num-redundant-experts", "2", "-o", str(out),
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for row in res["max_over_mean"].values():
        assert row["balanced"] <= row["default"] + 1e-9
    arch = DeepseekArch.from_pretrained(path)
    plan = build_plan(ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                                     expert_placement=str(out)), arch, rank=0)
    placement = json.loads(out.read_text())["layers"]
    assert {i: list(p.phys_to_logical) for i, p in plan.layers.items()} == {int(k): v for k, v in placement.items()}


def test_eplb_cli_errors_name_what_to_change(tmp_path, capsys):
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps([[1, 2, 3, 4]]))
    assert main(["eplb", str(stats), "--ep-size", "3"]) == 2
    assert "--num-redundant-experts" in capsys.readouterr().err
    assert main(["eplb", str(tmp_path / "missing.json"), "--ep-size", "2"]) == 2
    assert "missing.json" in capsys.readouterr().err
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps([1, 2, 3, 4]))
    assert main(["eplb", str(flat), "--ep-size", "2"]) == 2
    assert "--expert-load-stats" in capsys.readouterr().err
    assert main(["eplb", str(stats), "--ep-size", "2", "-o", str(tmp_path / "no-such-dir" / "p.json")]) == 2
    assert "--output" in capsys.readouterr().err
