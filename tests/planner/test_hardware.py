import json
import re
from importlib import resources

import pytest

from moeserve.perf.hardware import HardwareDB, load_hardware

REQUIRED = ["910b", "910c", "atlas-800i-a2", "cloudmatrix-384", "h100", "h800", "h200", "h20", "b200"]


def test_required_hardware_present():
    db = HardwareDB()
    for name in REQUIRED:
        hw = db.get(name)
        assert hw.bf16_tflops > 0 and hw.hbm_tbps > 0 and hw.scale_up_gbps > 0


def test_every_constant_has_a_source_comment():
    text = resources.files("moeserve.perf").joinpath("data/hardware.yaml").read_text()
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
    with pytest.raises(ValueError, match="no FP4 tensor path.*--quantization fp8"):
        load_hardware("h100").peak_flops("fp4")
    assert load_hardware("gb200-nvl72").peak_flops("fp4") == 10000e12


def test_user_file_adds_and_overrides(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({
        "devices": {"mychip": {"bf16_tflops": 100, "int8_tops": 200, "fp8_tflops": None, "hbm_gib": 32,
                               "hbm_tbps": 1.0, "scale_up_gbps": 50, "scale_out_gbps": 10}},
        "efficiency": {"devices": {"mychip": {"gemm": 0.5}}}}))
    db = HardwareDB(f)
    hw = db.get("mychip")
    # a new device takes the default factors (the CANN ones) except what it sets
    assert hw.eff.gemm == 0.5 and hw.eff.attention == db.get("910b").eff.attention
    y = tmp_path / "hw.yaml"
    y.write_text("systems:\n  big-h100:\n    device: h100\n    scale_up_domain: 72\n")
    assert HardwareDB(y).get("big-h100").scale_up_domain == 72


def test_user_file_merges_built_in_entries_field_by_field(tmp_path):
    """Restating one field of a built-in device, system or per-device efficiency entry changes that field
    and nothing else (it used to replace the whole entry)."""
    base = HardwareDB().get("h100")
    f = tmp_path / "hw.yaml"
    f.write_text("devices:\n  h100:\n    hbm_tbps: 4.0\n"
                 "systems:\n  hgx-h100:\n    scale_up_domain: 16\n"
                 "efficiency:\n  devices:\n    h100:\n      link: 0.5\n")
    db = HardwareDB(f)
    hw, system = db.get("h100"), db.get("hgx-h100")
    assert hw.hbm_tbps == 4.0 and hw.bf16_tflops == base.bf16_tflops and hw.hbm_gib == base.hbm_gib
    assert system.scale_up_domain == 16 and system.hbm_tbps == 4.0
    assert hw.eff.link == 0.5
    for field in ("gemm", "attention", "attention_memory", "memory", "mla_min_rows", "link_out"):
        assert getattr(hw.eff, field) == getattr(base.eff, field), field


def test_overrides_and_unknown():
    hw = load_hardware("h100").with_overrides(scale_out_gbps=100, gemm=0.5, scale_up_gbps=None)
    assert hw.scale_out_gbps == 100 and hw.eff.gemm == 0.5 and hw.scale_up_gbps == 450
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("tpu-v9")


DEVICE = {"bf16_tflops": 100, "int8_tops": 200, "hbm_gib": 32, "hbm_tbps": 1.0, "scale_up_gbps": 50,
          "scale_out_gbps": 10}
BAD_FILES = {  # name -> (file text, words the one-line error must contain)
    "negative_hbm": ({"devices": {"mychip": {**DEVICE, "hbm_tbps": -3.35}}}, ["mychip", "hbm_tbps", "-3.35"]),
    "zero_scale_out": ({"devices": {"mychip": {**DEVICE, "scale_out_gbps": 0}}}, ["mychip", "scale_out_gbps"]),
    "zero_domain": ({"systems": {"wide": {"device": "h100", "scale_up_domain": 0}}}, ["wide", "scale_up_domain"]),
    "negative_gemm": ({"efficiency": {"default": {"gemm": -0.8}}}, ["gemm", "[1e-06, 1]"]),
    # a denormal bandwidth or factor overflowed a time to inf (ZeroDivisionError in estimate), a huge
    # memory overflowed its byte count ("cannot convert float NaN to integer")
    "denormal_scale_out": ({"systems": {"s": {"device": "h100", "scale_out_gbps": 1e-320}}},
                           ["'s'", "scale_out_gbps", "[1e-06, 1e+09]"]),
    "denormal_tflops": ({"devices": {"mychip": {**DEVICE, "bf16_tflops": 1e-320}}}, ["mychip", "bf16_tflops"]),
    "denormal_fp8": ({"devices": {"mychip": {**DEVICE, "fp8_tflops": 5e-324}}}, ["mychip", "fp8_tflops"]),
    "denormal_fp4": ({"devices": {"mychip": {**DEVICE, "fp4_tflops": 5e-324}}}, ["mychip", "fp4_tflops"]),
    "misspelt_fp4": ({"devices": {"mychip": {**DEVICE, "fp4_tflop": 100}}}, ["mychip", "did you mean fp4_tflops"]),
    "huge_hbm": ({"devices": {"mychip": {**DEVICE, "hbm_gib": 1e300}}}, ["mychip", "hbm_gib", "1e+300"]),
    "inf_hbm_tbps": ({"devices": {"mychip": {**DEVICE, "hbm_tbps": float("inf")}}}, ["mychip", "hbm_tbps", "inf"]),
    "nan_scale_up": ({"devices": {"mychip": {**DEVICE, "scale_up_gbps": float("nan")}}}, ["scale_up_gbps", "nan"]),
    "denormal_gemm": ({"efficiency": {"default": {"gemm": 1e-320}}}, ["gemm", "[1e-06, 1]"]),
    "nan_link": ({"efficiency": {"devices": {"h100": {"link": float("nan")}}}}, ["h100", "link", "nan"]),
    "huge_latency": ({"efficiency": {"default": {"link_latency_us": 1e300}}}, ["link_latency_us", "1e+09"]),
    "inf_overhead": ({"efficiency": {"default": {"step_overhead_ms": float("inf")}}}, ["step_overhead_ms", "inf"]),
    "gemm_above_one": ({"efficiency": {"devices": {"h100": {"gemm": 1.5}}}}, ["h100", "gemm"]),
    "zero_serving": ({"efficiency": {"profiles": {"end_to_end": {"serving": 0}}}}, ["serving", "end_to_end"]),
    "missing_field": ({"devices": {"half": {"bf16_tflops": 100}}}, ["half", "lacks int8_tops"]),
    "text_value": ({"devices": {"mychip": {**DEVICE, "hbm_gib": "lots"}}}, ["mychip", "hbm_gib", "lots"]),
    "top_level_list": (["h100"], ["expected a mapping", "list"]),
    "devices_list": ({"devices": ["h100"]}, ["devices must be a mapping"]),
    "system_unknown_device": ({"systems": {"s": {"device": "nope"}}}, ["'s'", "'nope'"]),
    # a misspelt field used to be ignored, leaving the built-in value in place without a word
    "typo_in_system": ({"systems": {"s": {"device": "h100", "scale_up_gpbs": 900}}},
                       ["'s'", "'scale_up_gpbs'", "scale_up_gbps"]),
    "typo_in_device": ({"devices": {"mychip": {**DEVICE, "hbm_tbs": 2.0}}}, ["mychip", "'hbm_tbs'"]),
    "typo_in_profile": ({"efficiency": {"profiles": {"end_to_end": {"serveing": 0.43}}}},
                        ["end_to_end", "'serveing'", "serving"]),
    "typo_in_default": ({"efficiency": {"default": {"gem": 0.7}}}, ["efficiency.default", "'gem'"]),
    "typo_in_section": ({"device": {"mychip": DEVICE}}, ["top level", "'device'", "devices"]),
    "unknown_default_profile": ({"efficiency": {"default_profile": "fast"}}, ["'fast'", "end_to_end"]),
    # factors are looked up by device: under a system's name they were ignored
    "factors_on_a_system": ({"efficiency": {"devices": {"cloudmatrix-384": {"link": 0.9}}}},
                            ["efficiency.devices.cloudmatrix-384", "is a system", "efficiency.devices.910c"]),
    "factors_on_nothing": ({"efficiency": {"devices": {"h1000": {"gemm": 0.9}}}}, ["h1000", "not a device"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_hardware_file_names_the_file_and_the_field(case, tmp_path):
    data, words = BAD_FILES[case]
    f = tmp_path / "hw.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        HardwareDB(f)
    msg = str(e.value)
    assert str(f) in msg and "\n" not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("name,text,where", [("bad.yaml", "devices: [1, 2\n", "invalid YAML at line 2"),
                                             ("bad.json", '{"devices": {', "invalid JSON at line 1")])
def test_malformed_hardware_file_says_where(name, text, where, tmp_path):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match=where) as e:
        HardwareDB(f)
    assert str(f) in str(e.value)


def test_plan_hardware_reports_a_broken_device_without_a_traceback(tmp_path, capsys):
    from moeserve.planner.cli import main
    f = tmp_path / "hw.yaml"
    f.write_text("devices:\n  half:\n    bf16_tflops: 100\n")
    assert main(["plan", "hardware", "--hardware-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert "'half' lacks int8_tops" in err and str(f) in err


@pytest.mark.parametrize("kw", [{"scale_up_gbps": 0.0}, {"scale_out_gbps": -100.0}, {"hbm_tbps": 0.0},
                                {"scale_up_domain": 0}, {"serving": 0.0}, {"memory_utilization": 1.2},
                                {"scale_out_gbps": 1e-320}, {"scale_up_gbps": 1e300}])
def test_overrides_are_validated(kw):
    # 0 GB/s used to divide by zero in comm.link_time, a negative one to behave as infinitely fast
    with pytest.raises(ValueError, match=next(iter(kw))):
        load_hardware("h100").with_overrides(**kw)
