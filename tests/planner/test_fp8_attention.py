"""FP8 decode attention where a deployment runs FP8 MLA (FlashMLA-FP8; issue 41 stage 3)."""
import pytest

from moeserve.perf import cost
from moeserve.perf.deploy import Instance, PlanError
from moeserve.perf.hardware import HardwareDB, load_hardware
from moeserve.perf.models import load_model

V3 = load_model("deepseek-v3")


def test_fp8_mla_by_hand_on_h20():
    """H20, 128 heads x 2 positions (MTP): compute-bound; FlashMLA-FP8 is ~70% faster than BF16 FlashMLA
    (lmsys Ant Group blog, FlashMLA PR #82), on the FP8 cache's half bytes."""
    hw = load_hardware("hgx-h20")
    assert hw.eff.mla_fp8_gain == 0.7
    flops = 2 * 56 * 256 * 1088 * 4096
    bf16 = cost.mla_decode(V3, hw, Instance(cards=16, kv_dtype="fp8"), 56, 2, 4096)
    fp8 = cost.mla_decode(V3, hw, Instance(cards=16, kv_dtype="fp8", attention_dtype="fp8"), 56, 2, 4096)
    assert bf16.seconds == pytest.approx(flops / (148e12 * 0.667))
    assert fp8.seconds == pytest.approx(flops / (148e12 * 0.667 * 1.7))
    # memory-bound (one position, few heads with TP): the FP8 math changes nothing
    args = (V3, hw, Instance(cards=16, tp=8, kv_dtype="fp8"), 56, 1, 4096)
    mem = cost.mla_decode(*args)
    fp8_mem = cost.mla_decode(V3, hw, Instance(cards=16, tp=8, kv_dtype="fp8", attention_dtype="fp8"), 56, 1, 4096)
    assert fp8_mem.seconds <= mem.seconds


def test_fp8_attention_needs_the_fp8_cache_and_an_fp8_path():
    with pytest.raises(PlanError, match="--kv-cache-dtype fp8"):
        Instance(cards=16, attention_dtype="fp8")
    with pytest.raises(PlanError, match="--attention-dtype"):
        Instance(cards=16, attention_dtype="fp4")
    a2 = load_hardware("atlas-800i-a2")
    with pytest.raises(ValueError, match="no FP8 tensor path for --attention-dtype fp8"):
        cost.mla_decode(V3, a2, Instance(cards=16, kv_dtype="fp8", attention_dtype="fp8"), 8, 1, 4096)


def test_no_measured_gain_keeps_the_bf16_rate(tmp_path):
    """AMD has no FP8 MLA figure here: FP8 attention gets the FP8 cache's bytes, not a faster rate."""
    hw = load_hardware("mi300x-8")
    assert hw.eff.mla_fp8_gain is None
    a = cost.mla_decode(V3, hw, Instance(cards=8, kv_dtype="fp8"), 64, 2, 4096)
    b = cost.mla_decode(V3, hw, Instance(cards=8, kv_dtype="fp8", attention_dtype="fp8"), 64, 2, 4096)
    assert a.seconds == pytest.approx(b.seconds)
    f = tmp_path / "hw.yaml"
    f.write_text("efficiency:\n  devices:\n    mi300x: {mla_fp8_gain: 0.5}\n")
    c = cost.mla_decode(V3, HardwareDB(f).get("mi300x-8"), Instance(cards=8, kv_dtype="fp8", attention_dtype="fp8"),
                        64, 2, 4096)
    assert c.seconds < b.seconds


def test_cli_flag(capsys):
    from moeserve.planner.cli import main
    rc = main(["plan", "decode", "--hardware", "hgx-h20", "--cards", "16", "--quantization", "fp8",
               "--kv-cache-dtype", "fp8", "--attention-dtype", "fp8", "--batch-per-device", "8", "--json"])
    assert rc == 0
    rc = main(["plan", "decode", "--hardware", "atlas-800i-a2", "--cards", "32", "--kv-cache-dtype", "fp8",
               "--attention-dtype", "fp8", "--batch-per-device", "8", "--json"])
    assert rc == 2 and "--attention-dtype fp8" in capsys.readouterr().out
