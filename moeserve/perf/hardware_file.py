"""Reading the hardware database's YAML/JSON (built-in data/hardware.yaml, plus --hardware-file): errors
name the file and the entry, and the shape is checked before anything indexes into it."""
from __future__ import annotations

import difflib
import json
import math
from importlib import resources
from pathlib import Path

import yaml

from moeserve.files import read_text


def read(path: Path | None) -> dict:
    """The built-in table (path None) or a user file, as a checked mapping."""
    if path is None:
        text = resources.files("moeserve.perf").joinpath("data/hardware.yaml").read_text()
        return yaml.safe_load(text)
    text = read_text(path, f"--hardware-file {path}", "YAML or JSON")
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--hardware-file {path}: invalid JSON at line {err.lineno}, column {err.colno}: "
                         f"{err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"--hardware-file {path}: invalid YAML{where}: "
                         f"{getattr(err, 'problem', None) or err}") from None
    data = {} if data is None else data
    check_shape(data, f"--hardware-file {path}")
    return data


# Fields a file may set (hardware.py reads these and nothing else): an unknown one is a typo that would
# silently leave the built-in value in place.
DEVICE_FIELDS = ("name", "bf16_tflops", "int8_tops", "fp8_tflops", "fp4_tflops", "hbm_gib", "hbm_tbps",
                 "scale_up_gbps", "scale_out_gbps", "scale_up_domain", "collectives")
EFF_FIELDS = ("gemm", "attention", "memory", "link", "link_latency_us", "step_overhead_ms",
              "memory_utilization", "serving", "prefetch_attention_gain")
# Operator-level factors a file may set or leave out (hardware.py Efficiency: None falls back to the older
# factor), and the end-to-end terms a profile keeps (a list of hardware.TERMS names).
EFF_OPTIONAL = ("gemm_memory", "attention_memory", "link_out", "out_latency_us", "mla_min_rows", "mla_tflops",
                "tbo_max_gain", "mla_fp8_gain")
EFF_ALL = EFF_FIELDS + EFF_OPTIONAL + ("terms", "tbo_gain")  # tbo_gain: {tokens per card: gain}
COLLECTIVE_FIELDS = ("tokens", "hidden", "topk", "dispatch_bytes", "combine_bytes", "up_gbps", "out_gbps",
                     "domain", "points", "source", "normal_rdma", "normal_nic_gbps",
                     "normal_sm_share")
EFF_PARTS = ("default", "devices", "profiles", "default_profile", "ranges")
# Factors that may carry a documented range ([low, high] fractions of peak; hardware.py Efficiency.ranges).
RANGED_FIELDS = ("gemm", "attention", "memory", "link", "serving", "gemm_memory", "attention_memory",
                 "link_out")


def _known(src: str, where: str, keys, allowed) -> None:
    for k in keys:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(allowed)}"
            raise ValueError(f"{src}: {where} has unknown field {k!r}; {hint}")


def check_shape(data, src: str) -> None:
    """The file's sections are mappings of name -> mapping (what merge() and HardwareDB.get() index into)."""
    if not isinstance(data, dict):
        raise ValueError(f"{src}: expected a mapping with devices / systems / efficiency, got a "
                         f"{type(data).__name__}")
    for section in ("devices", "systems", "efficiency", "collectives"):
        sec = data.get(section)
        if sec is not None and not isinstance(sec, dict):
            raise ValueError(f"{src}: {section} must be a mapping, got a {type(sec).__name__}")
        for name, entry in ((sec or {}).items() if section != "efficiency" else ()):
            if not isinstance(entry, dict):
                raise ValueError(f"{src}: {section[:-1]} {name!r} must be a mapping of fields, got "
                                 f"{type(entry).__name__}")
            _known(src, f"{section[:-1]} {name!r}", entry,
                   COLLECTIVE_FIELDS if section == "collectives" else
                   DEVICE_FIELDS + (("device",) if section == "systems" else ()))
    _known(src, "the top level", data, ("devices", "systems", "efficiency", "collectives"))
    eff = data.get("efficiency") or {}
    _known(src, "efficiency", eff, EFF_PARTS)
    if eff.get("default") is not None and isinstance(eff["default"], dict):
        _no_ranges(src, "efficiency.default", eff["default"])
        _known(src, "efficiency.default", eff["default"], EFF_ALL)
    for part in ("default", "devices", "profiles"):
        if eff.get(part) is not None and not isinstance(eff[part], dict):
            raise ValueError(f"{src}: efficiency.{part} must be a mapping, got a {type(eff[part]).__name__}")
    for part in ("devices", "profiles"):
        for name, vals in (eff.get(part) or {}).items():
            if vals is not None and not isinstance(vals, dict):
                raise ValueError(f"{src}: efficiency.{part}.{name} must be a mapping of factors, got "
                                 f"{type(vals).__name__}")
            if part == "devices":
                _no_ranges(src, f"efficiency.devices.{name}", vals or {})
            _known(src, f"efficiency.{part}.{name}", vals or {},
                   EFF_ALL + (("ranges",) if part == "profiles" else ()))
            if part == "profiles":
                _check_ranges(src, f"efficiency.profiles.{name}.ranges", (vals or {}).get("ranges"))
    _check_ranges(src, "efficiency.ranges", eff.get("ranges"))


def _no_ranges(src: str, where: str, vals: dict) -> None:
    """`ranges` where none is read: say where they go (_known would only list the factors)."""
    if "ranges" in vals:
        raise ValueError(f"{src}: {where} cannot hold ranges; give them as efficiency.ranges or "
                         "efficiency.profiles.<profile>.ranges (a factor set for one device has no range)")


def _check_ranges(src: str, where: str, ranges) -> None:
    """factor -> [low, high], fractions of peak with low <= high."""
    if ranges is None:
        return
    if not isinstance(ranges, dict):
        raise ValueError(f"{src}: {where} must be a mapping of factor -> [low, high], got {type(ranges).__name__}")
    _known(src, where, ranges, RANGED_FIELDS)
    for k, pair in ranges.items():
        ok = (isinstance(pair, list) and len(pair) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair))
        if not ok or not 1e-6 <= pair[0] <= pair[1] <= 1.0:
            raise ValueError(f"{src}: {where}.{k} must be [low, high] with 1e-6 <= low <= high <= 1 "
                             f"(fractions of peak), got {pair!r}")


def number(entry: dict, field: str, what: str, cast=float):
    """entry[field] as a number (ranges are the dataclasses' checks); errors say what lacks what."""
    if field not in entry or entry[field] is None:
        raise ValueError(f"{what} lacks {field}")
    v = entry[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            cast is int and not (math.isfinite(v) and v == int(v))):
        raise ValueError(f"{what}: {field} must be a{'n integer' if cast is int else ' number'}, got {v!r}")
    return cast(v)


def _changed(old: dict | None, new: dict | None) -> dict:
    """The fields of `new` that differ from `old` (a restated built-in value is no change)."""
    return {k: v for k, v in (new or {}).items() if k not in (old or {}) or (old or {})[k] != v}


def _merge_ranges(base: dict | None, values: dict | None, ranges: dict | None) -> dict:
    """A factor the file changes without giving its range is pinned (its value is then the user's, so the
    built-in range no longer describes it); one restated at its built-in value keeps its range (`values`
    holds the changed factors only, _changed); ranges the file gives replace the built-in ones."""
    out = {k: v for k, v in (base or {}).items() if k not in (values or {})}
    out.update(ranges or {})
    return out


def _merge_entries(base: dict | None, extra: dict | None) -> dict:
    """Named entries (devices, systems, collective tables, per-device factors) merged field by field: a
    file that restates one field of a built-in entry changes that field only; new names are added whole."""
    out = dict(base or {})
    for name, fields in (extra or {}).items():
        old = out.get(name)
        out[name] = {**old, **fields} if isinstance(old, dict) and isinstance(fields, dict) else fields
    return out


def merge(base: dict, extra: dict) -> dict:
    """base with the user file's devices/systems added or changed field by field, and its efficiency factors
    overriding."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section in ("devices", "systems", "collectives"):
        out[section] = _merge_entries(out.get(section), extra.get(section))
    eff = extra.get("efficiency") or {}
    default = out["efficiency"]["default"]
    out["efficiency"]["default"] = {**default, **(eff.get("default") or {})}
    out["efficiency"]["ranges"] = _merge_ranges(out["efficiency"].get("ranges"),
                                                _changed(default, eff.get("default")), eff.get("ranges"))
    out["efficiency"]["devices"] = _merge_entries(out["efficiency"].get("devices"), eff.get("devices"))
    profiles = dict(out["efficiency"].get("profiles") or {})
    for name, vals in (eff.get("profiles") or {}).items():
        old = profiles.get(name) or {}
        profiles[name] = {**old, **(vals or {}),
                          "ranges": _merge_ranges(old.get("ranges"), _changed(old, vals),
                                                  (vals or {}).get("ranges"))}
    out["efficiency"]["profiles"] = profiles
    if eff.get("default_profile"):
        out["efficiency"]["default_profile"] = eff["default_profile"]
    return out
