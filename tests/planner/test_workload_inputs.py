"""Workload inputs a published deployment states (issue 41): a batch per device instead of a TPOT target,
the MTP acceptance as given, and the prompt tokens per device of a prefill forward."""
import json

import pytest

from moeserve.perf.deploy import Instance, Workload
from moeserve.perf.models import load_model
from moeserve.perf.hardware import load_hardware
from moeserve.planner.analysis import decode_point, requests_for_tokens
from moeserve.planner.cli import main

V3 = load_model("deepseek-v3")
H800 = ["--hardware", "hgx-h800", "--cards", "32", "--quantization", "fp8"]


def _json(capsys, argv):
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_batch_per_device_prices_that_batch_with_the_given_acceptance(capsys):
    code, out = _json(capsys, ["decode", *H800, "--batch-per-device", "64", "--mtp-drafts", "1",
                               "--mtp-acceptance", "0.8"])
    assert code == 0 and out["batch_per_device"] == 64
    inst = Instance(cards=32, quantization="fp8", mtp_drafts=1, mtp_acceptance=0.8)
    pt = decode_point(V3, load_hardware("hgx-h800"), inst, Workload(2048, 2048), 64)
    at = out["at_batch"]
    assert at["batch_per_dp"] == 64 and at["step_ms"] == pytest.approx(pt.step_ms, abs=1e-3)
    # 1 + 0.8 tokens per sequence per step, one card per DP group (TP1)
    assert at["tok_s_card"] == pytest.approx(64 * 1.8 / (at["step_ms"] / 1e3), rel=1e-3)
    assert at["tpot_ms"] == pytest.approx(at["step_ms"] / 1.8, abs=1e-3)


def test_batch_per_device_beyond_the_kv_room_is_refused_naming_the_flag(capsys):
    assert main(["plan", "decode", *H800, "--batch-per-device", "6400"]) == 1
    err = capsys.readouterr().err
    assert "--batch-per-device 6400 does not fit" in err and "--batch-per-device <=" in err
    assert main(["plan", "decode", *H800, "--max-num-seqs", "32", "--batch-per-device", "64"]) == 1
    assert "--max-num-seqs allows 32" in capsys.readouterr().err


def test_batch_per_device_and_tpot_are_alternatives(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "decode", *H800, "--batch-per-device", "8", "--tpot-ms", "20"])
    assert e.value.code == 2 and "not allowed with argument --batch-per-device" in capsys.readouterr().err


def test_tokens_per_device_sets_the_prompts_of_a_prefill(capsys):
    code, out = _json(capsys, ["prefill", *H800, "--tokens-per-device", "4096", "--input-len", "2048"])
    assert code == 0 and out["requests"] == 64            # 4096 x 32 cards / 2048
    code, same = _json(capsys, ["prefill", *H800, "--requests", "64", "--input-len", "2048"])
    assert same["ttft_ms"] == out["ttft_ms"]
    assert requests_for_tokens(Instance(cards=16), 1024, 4096) == 4
    assert main(["plan", "prefill", *H800, "--tokens-per-device", "100", "--input-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert "--tokens-per-device 100 x 32 cards" in err and "use a multiple of 64" in err
