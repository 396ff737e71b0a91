"""`moeserve plan validate --cases FILE`: a user's own published or measured results."""
import json

import pytest
import yaml

from moeserve.planner.calibrate import feasibility, load_cases, validate
from moeserve.planner.cli import main

A2 = {"id": "mine", "hardware": "atlas-800i-a2", "kind": "decode", "tpot_ms": 100,
      "workload": {"input_len": 2048, "output_len": 2048},
      "instance": {"cards": 32, "moe_comm": "allgather", "mtp_drafts": 1, "weight_prefetch": True,
                   "max_num_seqs": 60},
      "published": {"metric": "tok_s_card", "value": 808}}
PREFILL = {"id": "lite", "model": "deepseek-v2-lite", "hardware": "910b", "kind": "prefill", "requests": 4,
           "input_len": 1024, "instance": {"cards": 1, "quantization": "bf16"},
           "published": {"metric": "ttft_ms", "value": 60}}


def _file(tmp_path, data, name="cases.yaml") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return str(path)


def test_builtin_cases_pass_the_same_checks():
    table = load_cases()
    assert table["tolerance"] == 0.15 and len(table["cases"]) == 5 and len(table["unlisted"]) == 2
    assert all(c["model"] == "deepseek-v3" for c in table["cases"])


@pytest.mark.parametrize("name", ["cases.yaml", "cases.json"])
def test_a_users_case_predicts_as_the_builtin_one(tmp_path, name):
    builtin = {r["id"]: r for r in validate()["rows"]}["a2-decode-2k2k"]
    path = _file(tmp_path, {"tolerance": 0.2, "cases": [A2, PREFILL]}, name)
    res = validate(cases_file=path)
    mine, lite = res["rows"]
    assert mine["predicted"] == builtin["predicted"] and mine["band"] == builtin["band"]
    assert mine["within_tolerance"] == (abs(mine["error_pct"]) <= 20) and res["unlisted"] == []
    assert lite["unit"] == "ttft_ms" and lite["what"] == "lite" and lite["band"][0] < lite["predicted"]
    feas = feasibility(cases_file=path, points=2)
    assert set(feas["best_errors_pct"]) == {"mine", "lite"} and feas["tolerance_pct"] == 20


def _bad(**change):
    case = {**A2, **change}
    return {k: v for k, v in case.items() if v is not None}


@pytest.mark.parametrize("data, needles", [
    ([A2], ["expected a mapping"]),
    ({"cases": []}, ["non-empty list"]),
    ({"cases": [A2], "tolerence": 0.1}, ["unknown top-level field 'tolerence'"]),
    ({"cases": [A2], "tolerance": "15%"}, ["tolerance is a share"]),
    ({"cases": [A2, A2]}, ["cases[1] (mine)", "id used twice"]),
    ({"cases": [_bad(id=None)]}, ["cases[0]", "needs an id"]),
    ({"cases": [_bad(kind="both")]}, ["(mine)", "kind must be decode or prefill"]),
    ({"cases": [_bad(tpot_ms=None)]}, ["a decode case needs tpot_ms"]),
    ({"cases": [_bad(tpot_ms=-5)]}, ["tpot_ms must be a number in [1e-06, 1e+09]"]),
    ({"cases": [_bad(requests=8)]}, ["requests is for the other kind of case, not decode"]),
    ({"cases": [_bad(tpotms=5)]}, ["unknown field 'tpotms'"]),
    ({"cases": [_bad(instance={"tp": 2})]}, ["instance needs cards"]),
    ({"cases": [_bad(instance={"cards": "32"})]}, ["instance.cards must be an int, got '32'"]),
    ({"cases": [_bad(instance={"cards": 32, "weight_prefetch": "yes"})]}, ["instance.weight_prefetch must be a bool"]),
    ({"cases": [_bad(instance={"cards": 32, "mtp_acceptance": True})]}, ["instance.mtp_acceptance must be a float"]),
    ({"cases": [_bad(instance={"cards": 32, "gpus": 4})]}, ["instance: unknown field 'gpus'"]),
    ({"cases": [_bad(instance={"cards": 30, "tp": 4})]}, ["(mine)", "not divisible",
                                                         "make instance.cards a multiple of instance.tp"]),
    ({"cases": [_bad(workload={"input_len": 2048, "output": 5})]}, ["workload: unknown field 'output'"]),
    ({"cases": [_bad(published={"metric": "ttft_ms", "value": 5})]}, ["published.metric of a decode case"]),
    ({"cases": [_bad(published={"metric": "tok_s_card", "value": 0})]}, ["published.value must be a number in"]),
    ({"cases": [_bad(published={"metric": "tok_s_card", "value": 5, "source": "x"})]}, ["published is {metric, value}"]),
    ({"cases": [A2], "unlisted": [_bad(id="other", hardware=3)]}, ["unlisted[0] (other)", "hardware must be a string"]),
    # The limits the CLI flags enforce: these priced a nonsense row, overflowed, or printed Infinity in --json.
    ({"cases": [_bad(instance={"cards": 10 ** 30})]}, ["instance.cards must be <= 100000"]),
    ({"cases": [_bad(instance={"cards": 32, "imbalance": 1e300})]}, ["instance.imbalance must be <= 1e+09"]),
    ({"cases": [_bad(instance={"cards": 32, "mtp_drafts": 10 ** 400})]}, ["instance.mtp_drafts must be <= 1e+18"]),
    ({"cases": [_bad(workload={"input_len": -5})]}, ["workload.input_len must be an integer >= 1"]),
    ({"cases": [_bad(workload={"output_len": 0})]}, ["workload.output_len must be an integer >= 1"]),
    ({"cases": [_bad(workload={"prefix_hit": 1.5})]}, ["workload.prefix_hit is the share", "in [0, 1)"]),
    ({"cases": [{**PREFILL, "requests": 10 ** 30}]}, ["(lite)", "requests must be an integer in [1, 1e+18]"]),
    ({"cases": [_bad(tpot_ms=10 ** 400)]}, ["tpot_ms must be a number in", "got 10000000000000000000..."]),
    ({"cases": [_bad(published={"metric": "tok_s_card", "value": 1e-320})]}, ["published.value must be a number in"]),
    ({"cases": [A2], "tolerance": 10 ** 400}, ["tolerance is a share"]),
    ({"cases": [_bad(id="a\nb")]}, ["cases[0]", "id must be one line"]),
])
def test_bad_case_files_are_refused_naming_the_field(tmp_path, data, needles, capsys):
    path = _file(tmp_path, data)
    with pytest.raises(ValueError) as err:
        load_cases(path)
    for n in needles:
        assert n in str(err.value), (n, str(err.value))
    assert main(["plan", "validate", "--cases", path, "--json"]) == 2
    out = capsys.readouterr()
    assert needles[-1] in json.loads(out.out)["error"]  # one JSON object, and one line on stderr
    assert len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, needles, code", [
    ({"hardware": "tpu-v9"}, ["case 'mine'", "unknown hardware 'tpu-v9'"], 2),
    ({"model": "/nonexistent/model"}, ["case 'mine'"], 2),
    ({"hardware": "910b", "instance": {"cards": 8}}, ["case 'mine'", "exceed"], 1),  # memory: refused
    # Errors name the case's fields, not the flags of plan decode (--redundant-experts, --tp).
    ({"instance": {"cards": 48, "redundant_experts": 0}}, ["case 'mine'", "change instance.redundant_experts"], 2),
    ({"instance": {"cards": 256, "tp": 256}}, ["case 'mine'", "instance.tp 256 does not divide"], 2),
    # The model's context window binds as in plan decode/prefill (163840 for deepseek-v3): priced, exit 0.
    ({"workload": {"input_len": 200000, "output_len": 2048}},
     ["case 'mine'", "workload input_len 200000 + output_len 2048", "context window of 163840"], 2),
])
def test_cases_the_planner_cannot_price_name_the_case(tmp_path, change, needles, code, capsys):
    path = _file(tmp_path, {"cases": [{**A2, **change}]})
    assert main(["plan", "validate", "--cases", path]) == code
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, (n, err)


def test_a_prefill_prompt_beyond_the_context_window_is_refused(tmp_path, capsys):
    path = _file(tmp_path, {"cases": [{**PREFILL, "input_len": 200000}]})  # deepseek-v2-lite: 163840
    assert main(["plan", "validate", "--cases", path, "--json"]) == 2
    out = capsys.readouterr()
    assert "case 'lite': input_len 200000 exceeds" in json.loads(out.out)["error"]
    assert "context window of 163840" in out.err  # was exit 1, "activations ... exceed" memory


def test_a_decode_slo_no_batch_meets_says_so(tmp_path, capsys):
    path = _file(tmp_path, {"cases": [{**A2, "tpot_ms": 20}]})  # A2 at batch 1: ~36 ms
    row = validate(cases_file=path)["rows"][0]
    assert row["predicted"] == 0.0 and row["detail"] == {}  # counts as 0 tok/s/card ...
    assert row["note"].startswith("no batch meets tpot_ms 20: TPOT at batch 1 is ")  # ... and says why
    assert main(["plan", "validate", "--cases", path]) == 0
    assert "(no batch meets tpot_ms 20" in capsys.readouterr().out


def test_deeply_nested_file_is_an_error_not_a_traceback(tmp_path, capsys):
    for name, text in (("deep.yaml", "cases: " + "[" * 5000 + "]" * 5000), ("deep.json", "[" * 100000 + "]" * 100000)):
        path = tmp_path / name
        path.write_text(text)
        assert main(["plan", "validate", "--cases", str(path)]) == 2
        assert "nested too deeply" in capsys.readouterr().err


def test_unreadable_and_malformed_files(tmp_path, capsys):
    assert main(["plan", "validate", "--cases", str(tmp_path / "missing.yaml")]) == 2
    assert "--cases" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{cases: [")
    assert main(["plan", "validate", "--cases", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_redundant_experts_default_as_on_the_command_line(tmp_path, capsys):
    """Unset, a case gets the fewest redundant slots that divide the routed experts evenly (256 over 48
    ranks: 32), as `plan decode --cards 48` does; the published cases are unchanged by it (theirs divide)."""
    case = {**A2, "instance": {**A2["instance"], "cards": 48}}
    res = validate(cases_file=_file(tmp_path, {"cases": [case]}))
    assert main(["plan", "decode", "--json", "--hardware", "atlas-800i-a2", "--cards", "48", "--moe-comm",
                 "allgather", "--mtp-drafts", "1", "--weight-prefetch", "--tpot-ms", "100",
                 "--max-num-seqs", "60"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["layout"]["redundant_experts"] == 32
    assert res["rows"][0]["predicted"] == cli["best_under_slo"]["tok_s_card"]


def test_table_fits_long_ids_and_small_tolerances(tmp_path, capsys):
    long_id = "our-h800-cluster-decode-2k-in-1k-out-tpot-50ms"
    path = _file(tmp_path, {"tolerance": 0.001, "cases": [{**A2, "id": long_id}]})
    assert main(["plan", "validate", "--cases", path]) == 0
    out = capsys.readouterr().out.splitlines()
    head, row = out[1], out[2]
    assert row.startswith(long_id + " ") and head.index("unit") == row.index("tok_s_card")
    assert "tolerance +-0.1%" in "\n".join(out)
    path = _file(tmp_path, {"cases": [{**A2, "hardware": "tpu-v9"}]})
    assert main(["plan", "validate", "--cases", path]) == 2
    assert "--hardware-file adds devices and systems" in capsys.readouterr().err


def test_cases_may_state_batch_per_device_or_tokens_per_device(tmp_path):
    """A published deployment's own operating point (issue 41): the decode row is priced at that batch, the
    prefill row at tokens x cards / input_len prompts, exactly as the same case given as tpot_ms / requests."""
    from moeserve.perf.deploy import Instance, Workload
    from moeserve.perf.hardware import load_hardware
    from moeserve.perf.models import load_model
    from moeserve.planner.analysis import decode_point
    at_batch = {**{k: v for k, v in A2.items() if k != "tpot_ms"}, "id": "at-batch", "batch_per_device": 40}
    by_tokens = {**{k: v for k, v in PREFILL.items() if k != "requests"}, "id": "by-tokens",
                 "tokens_per_device": 4096}
    rows = validate(cases_file=_file(tmp_path, {"cases": [at_batch, by_tokens, PREFILL]}))["rows"]
    inst = Instance(cards=32, moe_comm="allgather", mtp_drafts=1, weight_prefetch=True, max_num_seqs=60,
                    redundant_experts=0)
    pt = decode_point(load_model("deepseek-v3"), load_hardware("atlas-800i-a2"), inst, Workload(2048, 2048), 40)
    assert rows[0]["predicted"] == round(pt.tok_s_card, 1) and rows[0]["detail"]["batch_per_dp"] == 40
    assert rows[1]["predicted"] == rows[2]["predicted"]          # 4096 tokens x 1 card / 1024 = 4 requests


@pytest.mark.parametrize("change, msg", [
    ({"batch_per_device": 8}, "give tpot_ms or batch_per_device, not both"),
    ({"tpot_ms": None}, "needs tpot_ms (or batch_per_device)"),
    ({"tokens_per_device": 64}, "tokens_per_device is for the other kind of case"),
    ({"batch_per_device": 0, "tpot_ms": None}, "batch_per_device must be an integer"),
])
def test_bad_stated_operating_points_are_refused(tmp_path, change, msg, capsys):
    case = {k: v for k, v in {**A2, **change}.items() if v is not None}
    assert main(["plan", "validate", "--cases", _file(tmp_path, {"cases": [case]})]) == 2
    assert msg in capsys.readouterr().err


def test_tokens_per_device_must_make_whole_prompts(tmp_path, capsys):
    case = {**{k: v for k, v in PREFILL.items() if k != "requests"}, "tokens_per_device": 1000}
    assert main(["plan", "validate", "--cases", _file(tmp_path, {"cases": [case]})]) == 2
    assert "tokens_per_device 1000 x 1 cards" in capsys.readouterr().err
