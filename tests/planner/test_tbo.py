"""Two-batch overlap's bound by device family and tokens per card (data/hardware.yaml tbo_gain; issue 41)."""
from dataclasses import replace

import pytest

from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import Efficiency, HardwareDB, load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step

V3 = load_model("deepseek-v3")
H100 = dict(cards=72, redundant_experts=32, quantization="fp8")   # SGLang's EP72 decode on 96 H100


def _serial_and_tbo(hw, kw, batch, ctx=2048):
    fw = hw.eff.step_overhead_ms * 1e-3
    serial = decode_step(V3, hw, Instance(**kw), batch, ctx).total - fw
    tbo = decode_step(V3, hw, Instance(**kw, micro_batch_overlap=True), batch, ctx).total - fw
    return serial, tbo


def test_bound_by_family_hand_interpolation():
    hop, asc = load_hardware("hgx-h100").eff, load_hardware("cloudmatrix-384-die").eff
    assert hop.tbo_gain == ((32, -0.27), (64, 0.0), (256, 0.35))
    assert hop.tbo_bound(16) == -0.27 and hop.tbo_bound(64) == 0.0          # flat below the first point
    assert hop.tbo_bound(160) == pytest.approx(0.35 * 96 / 192)             # linear between 64 and 256
    assert hop.tbo_bound(16384) == 0.35                                     # prefill: flat beyond 256
    assert asc.tbo_bound(96) == 0.094 and asc.tbo_bound(80) == pytest.approx(0.058 + 0.036 / 2)
    assert asc.tbo_bound(512) == 0.069                                      # CloudMatrix: +6.9% at 128
    for dev in ("h800", "h20", "b200", "gb200", "gb300"):                   # Hopper kernels / DeepEP
        assert load_hardware(dev).eff.tbo_gain == hop.tbo_gain
    assert load_hardware("atlas-800i-a2").eff.tbo_gain == asc.tbo_gain      # the Ascend default
    assert Efficiency(gemm=1, attention=1, memory=1, link=1, link_latency_us=0, step_overhead_ms=0,
                      memory_utilization=0.9, tbo_max_gain=0.2).tbo_bound(1000) == 0.2  # no table: the cap


def test_hopper_loses_at_32_tokens_and_gains_at_large_batch():
    """SGLang's H100 ablation: -27% at 32 tokens/device, gains only past 64-128 tokens."""
    hw = load_hardware("hgx-h100")
    serial, tbo = _serial_and_tbo(hw, H100, 32)
    assert tbo >= serial / (1 - 0.27) * (1 - 1e-9)         # the measured loss, at least
    serial, tbo = _serial_and_tbo(hw, H100, 64)
    assert tbo >= serial * (1 - 1e-9)                      # no gain at 64
    serial, tbo = _serial_and_tbo(hw, H100, 256)
    assert serial / 1.35 * (1 - 1e-9) <= tbo < serial / 1.2  # +20..35% at 256 tokens


def test_h20_gains_nothing_where_its_tpot_is_tight():
    """DeepEP PR #390 (Ant Group): on H20 TBO gains only at batch 64-128, where TPOT is already long."""
    hw = load_hardware("hgx-h20")
    for batch in (8, 16, 32, 64):
        serial, tbo = _serial_and_tbo(hw, dict(cards=16, quantization="fp8"), batch)
        assert tbo >= serial * (1 - 1e-9)


def test_cloudmatrix_microbatch_gain_within_the_measured_ten_percent():
    """CloudMatrix384: +5.8 / 9.4 / 6.9% at batch 64 / 96 / 128 per die."""
    hw = load_hardware("cloudmatrix-384-die")
    kw = dict(cards=144, shared_expert_ranks=16, quantization="a8w8")
    for batch, gain in ((64, 0.058), (96, 0.094), (128, 0.069)):
        serial, tbo = _serial_and_tbo(hw, kw, batch, 4096)
        assert tbo >= serial / (1 + gain) * (1 - 1e-9)


def test_prefill_bound_by_tokens_per_card():
    hw = load_hardware("hgx-h800")
    inst = Instance(cards=32, redundant_experts=32, quantization="fp8")
    serial = prefill_step(V3, hw, inst, 4, 4096).total
    tbo = prefill_step(V3, hw, replace(inst, micro_batch_overlap=True), 4, 4096).total
    assert tbo >= (serial - 1e-3) / 1.35 + 1e-3 - 1e-12


@pytest.mark.parametrize("table,msg", [({}, "tbo_gain must map"), ({0: 0.1}, "tokens per card"),
                                       ({64: -1.5}, "gain in"), ([1, 2], "tbo_gain must map")])
def test_hardware_file_tbo_gain_checked(tmp_path, table, msg):
    f = tmp_path / "hw.yaml"
    import yaml
    f.write_text(yaml.safe_dump({"efficiency": {"devices": {"h100": {"tbo_gain": table}}}}))
    with pytest.raises(ValueError, match=msg):
        HardwareDB(f).get("h100")


def test_hardware_file_tbo_gain_replaces_the_table_whole(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text("efficiency:\n  devices:\n    h100:\n      tbo_gain: {128: 0.1}\n")
    eff = HardwareDB(f).get("hgx-h100").eff
    assert eff.tbo_gain == ((128, 0.1),) and eff.tbo_bound(8) == 0.1
    assert eff.gemm == load_hardware("hgx-h100").eff.gemm                    # the rest of the entry stays


def test_hardware_file_json_keys_are_strings(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text('{"efficiency": {"devices": {"h100": {"tbo_gain": {"64": 0.0, "256": 0.2}}}}}')
    assert HardwareDB(f).get("h100").eff.tbo_gain == ((64.0, 0.0), (256.0, 0.2))
    f.write_text('{"efficiency": {"devices": {"h100": {"tbo_gain": {"many": 0.1}}}}}')
    with pytest.raises(ValueError, match="tbo_gain keys"):
        HardwareDB(f).get("h100")
