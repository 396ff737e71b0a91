"""--hardware-file merges field by field (issue 41): restating built-in values changes no figure, no band and
no plan; changing one field moves only the terms that read it."""
import json

import pytest
import yaml

from moeserve.cli import main
from moeserve.perf.hardware import HardwareDB
from moeserve.perf.hardware_file import RANGED_FIELDS, read


def _every(db: HardwareDB) -> dict:
    """Every device and system, at its point factors and at both ends of its documented ranges."""
    return {n: (db.get(n), db.get(n).at("low"), db.get(n).at("high")) for n in db.names()}


def _write(tmp_path, doc: dict, name="hw.yaml"):
    f = tmp_path / name
    f.write_text(yaml.safe_dump(doc))
    return str(f)


@pytest.mark.parametrize("profile", ["end_to_end", "kernel"])
def test_restating_the_whole_built_in_table_changes_nothing(tmp_path, profile):
    """Every built-in entry restated at once: the efficiency.default factors used to be pinned (their
    documented ranges dropped) although their values were the built-in ones, so every band narrowed."""
    f = _write(tmp_path, read(None))
    assert _every(HardwareDB(f, profile)) == _every(HardwareDB(None, profile))


@pytest.mark.parametrize("factor", sorted(set(RANGED_FIELDS) - {"serving"}))
def test_restating_one_default_factor_keeps_its_range(tmp_path, factor):
    default = read(None)["efficiency"]["default"]
    if factor not in default:
        pytest.skip(f"{factor} is not a built-in default")
    f = _write(tmp_path, {"efficiency": {"default": {factor: default[factor]}}})
    assert _every(HardwareDB(f)) == _every(HardwareDB())


def test_restating_a_devices_effective_factor_keeps_its_range(tmp_path):
    """910c takes gemm from efficiency.default (ranged); stating that same value for the device is no change."""
    base = HardwareDB().get("910c")
    assert any(r[0] == "gemm" for r in base.eff.ranges)
    f = _write(tmp_path, {"efficiency": {"devices": {"910c": {"gemm": base.eff.gemm}}}})
    assert HardwareDB(f).get("910c") == base
    changed = HardwareDB(_write(tmp_path, {"efficiency": {"devices": {"910c": {"gemm": 0.78}}}})).get("910c")
    assert changed.eff.gemm == 0.78 and not any(r[0] == "gemm" for r in changed.eff.ranges)  # pinned


def test_changing_a_default_factor_still_pins_it(tmp_path):
    f = _write(tmp_path, {"efficiency": {"default": {"gemm": 0.79}}})
    hw = HardwareDB(f).get("atlas-800i-a2")
    assert hw.eff.gemm == 0.79 and "gemm" not in [r[0] for r in hw.eff.ranges]
    assert "attention" in [r[0] for r in hw.eff.ranges]


def _plan(capsys, *extra):
    code = main(["plan", "estimate", "--hardware", "atlas-800i-a2", "--cards", "32", "--batch", "16", "--json",
                 *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_restated_file_gives_the_identical_plan(tmp_path, capsys):
    f = _write(tmp_path, {"devices": {"910b": {"hbm_tbps": 1.6, "scale_out_gbps": 50}},
                          "systems": {"atlas-800i-a2": {"scale_out_gbps": 25}},
                          "efficiency": {"default": {"attention_memory": 0.841, "gemm": 0.80}}})
    assert _plan(capsys, "--hardware-file", f) == _plan(capsys)


@pytest.mark.parametrize("doc,moved", [
    # decode MLA on the 910B (128 heads per card) is compute-bound at `attention`: only its kernel moves
    ({"efficiency": {"default": {"attention": 0.60}}}, {"mla_decode"}),
    # 32 cards = 4 Atlas nodes: the all-to-all crosses RoCE, nothing else does
    ({"systems": {"atlas-800i-a2": {"scale_out_gbps": 20}}}, {"dispatch", "combine"}),
])
def test_changing_one_field_moves_only_its_terms(tmp_path, capsys, doc, moved):
    base = _plan(capsys)["decode"]["breakdown_ms"]
    new = _plan(capsys, "--hardware-file", _write(tmp_path, doc))["decode"]["breakdown_ms"]
    assert base.keys() == new.keys()
    assert {k for k in base if new[k] != base[k]} == moved
    assert all(new[k] > base[k] for k in moved)  # a lower rate is slower
