"""Bad input to `moeserve plan` is one error line that names the flag, never a traceback or a silent default."""
import json

import pytest

from moeserve.planner.cli import main


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `moeserve plan ...`; argparse refusals exit through SystemExit."""
    try:
        code = main(["plan", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


REFUSED = [  # (argv, flag the message must name)
    (["estimate", "--batch", "-5"], "--batch"),
    (["estimate", "--batch", "0"], "--batch"),  # 0 used to fall back to the default (max batch)
    (["estimate", "--prefill-requests", "-3"], "--prefill-requests"),
    (["estimate", "--prefill-requests", "0"], "--prefill-requests"),
    (["estimate", "--prefill-cards", "0"], "--prefill-cards"),
    (["estimate", "--prefill-tp", "0"], "--prefill-tp"),
    (["prefill", "--requests", "-4"], "--requests"),
    (["prefill", "--requests", "0"], "--requests"),
    (["estimate", "--imbalance", "0"], "--imbalance"),
    (["estimate", "--imbalance", "0.5"], "--imbalance"),
    (["simulate", "--rate", "0"], "--rate"),
    (["simulate", "--rate", "-1", "--arrival", "constant"], "--rate"),
    (["simulate", "--rate", "inf"], "--rate"),
    (["simulate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["simulate", "--num-requests", "0"], "--num-requests"),
    (["simulate", "--role", "pd"], "--prefill-cards"),  # a PD deployment needs its prefill instance
    (["simulate", "--prefill-cards", "16"], "--role pd"),  # prefill flags without PD were ignored
    (["simulate", "--decode-instances", "2"], "--role pd"),
    (["simulate", "--pd-proxy", "round-robin"], "--role pd"),
    (["simulate", "--role", "pd", "--prefill-cards", "16", "--pd-proxy", "random"], "--pd-proxy"),
    (["simulate", "--role", "pd", "--prefill-cards", "16", "--prefill-instances", "0"], "--prefill-instances"),
    (["simulate", "--sim-dp-groups", "0"], "--sim-dp-groups"),
    (["search", "--simulate", "0"], "--simulate"),
    (["search", "--simulate-load", "1.5"], "--simulate-load"),  # a fraction of the plan's rate
    (["search", "--simulate-load", "0"], "--simulate-load"),
    (["search", "--simulate-load", "0.5"], "--simulate N"),  # without --simulate it would do nothing
    (["search", "--simulate-requests", "7"], "--simulate N"),
    (["simulate", "--sim-dp-groups", "3"], "--sim-dp-groups"),  # must divide the DP size
    (["profile-cpu", "--threads", "0"], "--threads"),
    (["profile-cpu", "--threads", "-1"], "--threads"),
    (["profile-cpu", "--batches", "0,-4"], "--batches"),
    (["estimate", "--cards", "0"], "--cards"),
    (["search", "--cards", "0"], "--cards"),
    (["estimate", "--cards", "16", "--shared-expert-ranks", "16"], "--shared-expert-ranks"),
    (["estimate", "--shared-expert-ranks", "-1"], "--shared-expert-ranks"),
    (["estimate", "--redundant-experts", "-2"], "--redundant-experts"),
    (["estimate", "--output-len", "0"], "--output-len"),
    (["decode", "--input-len", "0"], "--input-len"),
    (["decode", "--input-len", "-100"], "--input-len"),
    (["estimate", "--tp", "0"], "--tp"),
    (["estimate", "--mtp-acceptance", "1.5"], "--mtp-acceptance"),
    (["estimate", "--mtp-drafts", "-1"], "--mtp-drafts"),
    (["search", "--top", "0"], "--top"),
    (["search", "--top", "-1"], "--top"),
    (["search", "--tpot-ms", "-5"], "--tpot-ms"),
    (["search", "--ttft-ms", "0"], "--ttft-ms"),
    (["decode", "--scale-up-gbps", "-100"], "--scale-up-gbps"),
    (["decode", "--scale-up-gbps", "0"], "--scale-up-gbps"),
    (["decode", "--scale-out-gbps", "0"], "--scale-out-gbps"),
    (["decode", "--scale-up-domain", "0"], "--scale-up-domain"),
    (["decode", "--scale-up-domain", "-8"], "--scale-up-domain"),
    # finite and > 0 was not enough: a denormal bandwidth overflowed a time to inf (ZeroDivisionError),
    # a denormal rate put arrivals at inf, a huge imbalance made the MoE time inf
    (["estimate", "--hardware", "atlas-800i-a2", "--cards", "32", "--scale-out-gbps", "1e-320"], "--scale-out-gbps"),
    (["estimate", "--scale-up-gbps", "1e-320"], "--scale-up-gbps"),
    (["estimate", "--scale-up-gbps", "1e300"], "--scale-up-gbps"),
    (["estimate", "--scale-out-gbps", "inf"], "--scale-out-gbps"),
    (["estimate", "--scale-up-gbps", "nan"], "--scale-up-gbps"),
    (["estimate", "--imbalance", "1e300"], "--imbalance"),
    (["estimate", "--imbalance", "nan"], "--imbalance"),
    (["estimate", "--mtp-acceptance", "nan"], "--mtp-acceptance"),
    (["simulate", "--rate", "1e-320"], "--rate"),
    (["search", "--tpot-ms", "nan"], "--tpot-ms"),
    (["search", "--ttft-ms", "inf"], "--ttft-ms"),
    (["search", "--simulate", "1", "--simulate-load", "1e-320"], "--simulate-load"),
    # huge counts: search --cards 1e30 ran forever (its split counts instances up to --cards), --num-requests
    # 1e30 allocated without end, --threads 1e30 said "Overflow when unpacking long long", 10**400 overflowed
    (["search", "--cards", "100001"], "--cards"),
    (["search", "--cards", str(10 ** 30)], "--cards"),
    (["estimate", "--prefill-cards", "100001"], "--prefill-cards"),
    (["estimate", "--cards", "1" + "0" * 400], "--cards"),
    (["estimate", "--input-len", "1" + "0" * 400], "--input-len"),
    (["simulate", "--num-requests", str(10 ** 30)], "--num-requests"),
    (["simulate", "--num-requests", "2000000"], "--num-requests"),
    (["simulate", "--role", "pd", "--prefill-cards", "16", "--decode-instances", "2000"], "--decode-instances"),
    (["simulate", "--role", "pd", "--prefill-cards", "16", "--prefill-instances", str(10 ** 30)],
     "--prefill-instances"),
    (["search", "--simulate", "1", "--simulate-requests", "10000000", "--model", "deepseek-v2-lite",
      "--hardware", "h100", "--cards", "16"], "--simulate-requests"),
    (["profile-cpu", "--threads", str(10 ** 30)], "--threads"),
]


@pytest.mark.parametrize("argv,flag", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_value_is_refused_naming_the_flag(argv, flag, capsys):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert flag in err and "Traceback" not in err
    assert len([l for l in err.splitlines() if "error" in l]) == 1


def test_tp_error_names_the_flags(capsys):
    code, _, err = run(capsys, "estimate", "--cards", "24", "--tp", "16")
    assert code == 2 and "--cards" in err and "--tp" in err


@pytest.mark.parametrize("argv,words", [
    # V3's context window is 163840 tokens (max_position_embeddings); this used to return a decode point
    (["decode", "--hardware", "hgx-h200", "--input-len", "500000", "--tpot-ms", "1000"],
     ["--input-len 500000", "--output-len 2048", "163840"]),
    (["estimate", "--input-len", "163000", "--output-len", "1000"], ["--output-len 1000", "163840"]),
    (["prefill", "--input-len", "200000"], ["--input-len 200000", "163840"]),
])
def test_context_beyond_the_model_window_is_refused(argv, words, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2
    for w in words:
        assert w in err


def test_prefill_ignores_the_output_length_for_the_window(capsys):
    code, out, err = run(capsys, "prefill", "--input-len", "163000", "--output-len", "2048", "--requests", "1",
                         "--hardware", "hgx-h200")
    assert code == 0 and "prefill 1 x 163000" in out


@pytest.mark.parametrize("argv,flag", [(["estimate", "--cards", "256", "--tp", "256"], "--tp 256"),
                                       (["estimate", "--prefill-cards", "96", "--prefill-tp", "96"], "--prefill-tp 96"),
                                       (["decode", "--model", "moeserve-bench", "--cards", "32", "--tp", "32"], "--tp 32")])
def test_tp_must_divide_the_attention_heads(argv, flag, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2 and flag in err and "attention heads" in err


def test_library_refuses_tp_that_does_not_divide_the_heads():
    from moeserve.perf.deploy import Instance, PlanError
    from moeserve.planner.memory import weights_per_card
    from moeserve.perf.models import load_model
    with pytest.raises(PlanError, match="attention heads"):
        weights_per_card(load_model("deepseek-v3"), Instance(cards=256, tp=256))


def test_unwritable_plot_path_is_refused_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "somefile.json"
    blocker.write_text("{}")
    for bad in (blocker / "x.png", tmp_path / "missing" / "x.png", tmp_path / "x.json", tmp_path):
        code, out, err = run(capsys, "decode", "--plot", str(bad))
        assert code == 2 and f"--plot {bad}" in err and "Traceback" not in err


def test_plot_without_suffix_reports_the_file_written(tmp_path, capsys, monkeypatch):
    import json
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "decode", "--hardware", "atlas-800i-a2", "--moe-comm", "allgather",
                       "--plot", "curve", "--json")
    assert code == 0 and json.loads(out)["plot"] == "curve.png"
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


JSON_ERRORS = {  # subcommand -> (arguments that fail, exit code: 1 refused, 2 bad input)
    "estimate": (["--cards", "30", "--redundant-experts", "0"], 2),
    "decode": (["--hardware", "tpu-v9"], 2),
    "prefill": (["--hardware", "910b", "--cards", "8"], 1),  # does not fit in memory
    "memory": (["--cards", "24", "--tp", "16"], 2),
    "search": (["--top", "0"], 2),
    "simulate": (["--rate", "0"], 2),
    "validate": (["--hardware-file", "/nonexistent/hw.yaml"], 2),
    "hardware": (["--hardware-file", "/nonexistent/hw.yaml"], 2),
    "profile-cpu": (["--threads", "0"], 2),
}


@pytest.mark.parametrize("cmd", sorted(JSON_ERRORS))
def test_errors_with_json_print_one_error_object(cmd, capsys):
    import json
    argv, want = JSON_ERRORS[cmd]
    code, out, err = run(capsys, cmd, "--json", *argv)
    assert code == want
    obj = json.loads(out)  # exactly one object on stdout...
    assert list(obj) == ["error"] and obj["error"] in err  # ...and the same message on stderr
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_simulate_refuses_a_layout_that_does_not_fit(capsys):
    # used to fail inside the engine scheduler, naming engine flags (--num-kv-blocks) plan does not have
    code, out, err = run(capsys, "simulate", "--hardware", "h100", "--cards", "1", "--num-requests", "5")
    assert code == 1 and "exceed" in err and "--num-kv-blocks" not in err
    code, out, err = run(capsys, "simulate", "--hardware", "h100", "--cards", "16", "--role", "pd",
                         "--prefill-cards", "2", "--num-requests", "5")
    assert code == 1 and "prefill instance (2 cards): weights" in err
    code, out, err = run(capsys, "simulate", "--hardware", "h100", "--cards", "2", "--role", "pd",
                         "--prefill-cards", "16", "--num-requests", "5")
    assert code == 1 and "decode instance (2 cards): weights" in err


def test_exit_codes_refused_vs_bad_input(capsys):
    # the same memory refusal exits 1 from every subcommand (memory always did; estimate used to exit 2)
    assert run(capsys, "memory", "--hardware", "910b", "--cards", "8")[0] == 1
    assert run(capsys, "estimate", "--hardware", "910b", "--cards", "8")[0] == 1
    assert run(capsys, "decode", "--hardware", "910b", "--cards", "8")[0] == 1
    assert run(capsys, "estimate", "--hardware", "tpu-v9")[0] == 2
    assert run(capsys, "estimate", "--no-such-flag")[0] == 2


@pytest.mark.parametrize("argv,label", [
    (["--hardware", "910b", "--cards", "8"], "decode instance (8 cards): weights"),
    (["--prefill-cards", "8"], "prefill instance (8 cards): weights"),
    (["--input-len", "100000", "--output-len", "100"], "prefill on the decode layout (32 cards): weights"),
    (["--prefill-cards", "12", "--prefill-tp", "8"], "prefill instance (12 cards): --prefill-cards 12"),
])
def test_estimate_says_which_instance_is_refused(argv, label, capsys):
    code, _, err = run(capsys, "estimate", *argv)
    assert code in (1, 2) and label in err


def test_activation_bound_refusal_does_not_advise_spreading_experts(capsys):
    # 100K-token prompts: the prefill step's workspace (42.7 GiB), not the weights (37.4 GiB), overflows
    _, _, err = run(capsys, "estimate", "--input-len", "100000", "--output-len", "100")
    assert "fewer tokens in one step" in err and "spread experts" not in err


def test_batch_beyond_the_kv_room_is_refused_not_capped(capsys):
    code, out, err = run(capsys, "estimate", "--batch", "100000", "--json")
    assert code == 1 and "--batch 100000 does not fit" in err and "use --batch <=" in err
    assert '"error"' in out


def test_simulate_refuses_a_prefill_pool_the_scheduler_cannot_use(capsys):
    # 16 x 512-token prompts fit, but the workspace of an 8192-token step per DP group (its allgather buffer
    # holds 16 x 8192 tokens) leaves no KV: this exited 2 with the engine's "raise --num-kv-blocks"
    argv = ["simulate", "--hardware", "atlas-800i-a2", "--cards", "32", "--moe-comm", "allgather", "--role", "pd",
            "--prefill-cards", "16", "--input-len", "512", "--output-len", "512", "--num-requests", "5"]
    code, out, err = run(capsys, *argv)
    assert code == 1 and "prefill instance" in err and "--max-num-batched-tokens" in err
    assert "--num-kv-blocks" not in err and "Traceback" not in err
    code, out, err = run(capsys, *argv, "--max-num-batched-tokens", "512")  # a step the pool holds: runs
    assert code == 0, err


def test_simulate_far_above_capacity_reports_overload_instead_of_a_traceback(capsys):
    # --rate 3000 raised OverflowError in the analytic fixed point (a batch of 1e79)
    code, out, err = run(capsys, "simulate", "--json", "--model", "deepseek-v2-lite", "--hardware", "h100",
                         "--cards", "2", "--quantization", "bf16", "--input-len", "512", "--output-len", "16",
                         "--num-requests", "5", "--rate", "1e7")
    assert code == 0 and "Traceback" not in err, err
    ana = json.loads(out)["analytic_steady_state"]
    assert ana["overloaded"] is True and ana["batch_per_dp"] is None and ana["capacity_req_s"] < 1e7


@pytest.mark.parametrize("flag,name", [("--hardware-file", "hw.yaml"), ("--model", "config.json"),
                                       ("--eplb-stats", "load.json")])  # the last named neither
def test_a_file_that_is_not_text_is_refused_naming_the_flag_and_file(flag, name, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(b"\xff\xfe\x00binary")
    code, out, err = run(capsys, "estimate", flag, str(path), "--json")
    assert code == 2
    assert flag in err and str(path) in err and "UTF-8" in err
    assert json.loads(out)["error"] in err


def test_search_at_the_card_limit_stays_fast(capsys):
    import time
    t = time.monotonic()
    code, out, err = run(capsys, "search", "--cards", "100000", "--json")
    assert code == 0 and json.loads(out)["plans"] and time.monotonic() - t < 30


def test_simulate_on_a_huge_memory_device_caps_its_kv_pool(tmp_path, capsys):
    # 1e9 GiB per card: the scheduler's pool held ~1e12 block ids (11 GB of RAM and no end)
    f = tmp_path / "hw.yaml"
    f.write_text("devices:\n  big:\n    bf16_tflops: 1000\n    int8_tops: 2000\n    hbm_gib: 1.0e+9\n"
                 "    hbm_tbps: 3\n    scale_up_gbps: 400\n    scale_out_gbps: 50\n")
    code, out, err = run(capsys, "simulate", "--model", "deepseek-v2-lite", "--hardware", "big", "--hardware-file",
                         str(f), "--cards", "2", "--num-requests", "20", "--json")
    assert code == 0, err
    assert json.loads(out)["num_requests"] == 20


@pytest.mark.parametrize("field,value,words", [
    ("num_hidden_layers", 10 ** 30, ["num_hidden_layers", "2147483647"]),  # counted its layers in a loop: no end
    ("hidden_size", 10 ** 400, ["hidden_size", "2147483647"]),  # OverflowError: int too large to convert to float
])
def test_model_config_with_huge_counts_is_refused(field, value, words, tmp_path, capsys):
    from moeserve.perf.models import _preset_table
    cfg = {**_preset_table()["deepseek-v3"], field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "estimate", "--model", str(path), "--json")
    assert code == 2 and f"--model {path}" in err and "Traceback" not in err
    for w in words:
        assert w in err
