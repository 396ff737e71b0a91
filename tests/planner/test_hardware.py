import json
import re
from importlib import resources

import pytest

from moeserve.planner.hardware import HardwareDB, load_hardware

REQUIRED = ["910b", "910c", "atlas-800i-a2", "cloudmatrix-384", "h100", "h800", "h200", "h20", "b200"]


def test_required_hardware_present():
    db = HardwareDB()
    for name in REQUIRED:
        hw = db.get(name)
        assert hw.bf16_tflops > 0 and hw.hbm_tbps > 0 and hw.scale_up_gbps > 0


def test_every_constant_has_a_source_comment():
    text = resources.files("moeserve.planner").joinpath("data/hardware.yaml").read_text()
    block = None
    for line in text.splitlines():
        if re.match(r"^\w", line):
            block = line.split(":")[0]
        if block in ("devices", "efficiency") and re.match(r"^\s+\w+:\s*[0-9.]+\s*(#.*)?$", line):
            assert "#" in line, f"constant without a source comment: {line.strip()}"


def test_known_values():
    assert load_hardware("h800").scale_up_gbps == 160  # measured, hardware.md
    assert load_hardware("atlas-800i-a2").hbm_gib == 64
    with pytest.raises(ValueError, match="no FP8"):
        load_hardware("910b").peak_flops("fp8")


def test_user_file_adds_and_overrides(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({
        "devices": {"mychip": {"bf16_tflops": 100, "int8_tops": 200, "fp8_tflops": None, "hbm_gib": 32,
                               "hbm_tbps": 1.0, "scale_up_gbps": 50, "scale_out_gbps": 10}},
        "efficiency": {"devices": {"mychip": {"gemm": 0.5}}}}))
    db = HardwareDB(f)
    hw = db.get("mychip")
    assert hw.eff.gemm == 0.5 and hw.eff.attention == db.get("h100").eff.attention
    y = tmp_path / "hw.yaml"
    y.write_text("systems:\n  big-h100:\n    device: h100\n    scale_up_domain: 72\n")
    assert HardwareDB(y).get("big-h100").scale_up_domain == 72


def test_overrides_and_unknown():
    hw = load_hardware("h100").with_overrides(scale_out_gbps=100, gemm=0.5, scale_up_gbps=None)
    assert hw.scale_out_gbps == 100 and hw.eff.gemm == 0.5 and hw.scale_up_gbps == 450
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("tpu-v9")
