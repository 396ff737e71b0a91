"""Hardware database: devices, systems (device + wiring) and efficiency factors, all as data.

The built-in table is data/hardware.yaml; users add or override entries with a YAML/JSON file of the
same shape (`--hardware-file`). Units: TFLOPS, GiB, TB/s, GB/s unidirectional per card.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import yaml

GIB = 2 ** 30
_EFF_KEYS = ("gemm", "attention", "memory", "link", "link_latency_us", "step_overhead_ms",
             "memory_utilization", "serving", "prefetch_attention_gain")
PROFILES = ("end_to_end", "kernel")


@dataclass(frozen=True)
class Efficiency:
    gemm: float              # achieved / peak tensor FLOPs in GEMMs
    attention: float         # achieved / peak for attention kernels (FLOPs and KV bytes)
    memory: float            # achieved / peak HBM bandwidth for weight streaming
    link: float              # achieved / nominal link bandwidth
    link_latency_us: float   # fixed cost per collective / dispatch / combine
    step_overhead_ms: float  # per engine step (scheduling, launch, sampling)
    memory_utilization: float  # usable fraction of HBM
    # End-to-end serving / kernel-level achieved rate, applied to every on-device compute operator
    # (GEMM, attention, memory-bound kernels; not to collectives, whose constants are already measured
    # operation times, nor to the per-step overhead). 1.0 = the kernel-level profile.
    serving: float = 1.0
    # Measured speed-up of the attention block from prefetching its weights during communication
    # (Instance.weight_prefetch); an upper bound on what step.py lets the technique hide.
    prefetch_attention_gain: float = 0.10


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    bf16_tflops: float
    int8_tops: float
    fp8_tflops: float | None
    hbm_gib: float
    hbm_tbps: float
    scale_up_gbps: float
    scale_out_gbps: float
    scale_up_domain: int
    eff: Efficiency

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for GEMM inputs of this dtype ('bf16', 'int8', 'fp8')."""
        if dtype == "bf16":
            return self.bf16_tflops * 1e12
        if dtype == "int8":
            return self.int8_tops * 1e12
        if dtype == "fp8":
            if not self.fp8_tflops:
                raise ValueError(f"{self.name} has no FP8 tensor path; use --quantization a8w8 or bf16")
            return self.fp8_tflops * 1e12
        raise ValueError(f"unknown compute dtype {dtype!r}")

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    @property
    def hbm_bw(self) -> float:  # bytes/s
        return self.hbm_tbps * 1e12

    def with_overrides(self, **kw) -> "Hardware":
        """Change wiring/peaks (e.g. --scale-up-gbps) while keeping the rest."""
        kw = {k: v for k, v in kw.items() if v is not None}
        eff_kw = {k: kw.pop(k) for k in list(kw) if k in _EFF_KEYS}
        hw = replace(self, **kw)
        return replace(hw, eff=replace(hw.eff, **eff_kw)) if eff_kw else hw


def _read(path: Path | None) -> dict:
    if path is None:
        text = resources.files("moeserve.planner").joinpath("data/hardware.yaml").read_text()
        return yaml.safe_load(text)
    text = Path(path).read_text()
    return json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section in ("devices", "systems"):
        out.setdefault(section, {}).update(extra.get(section) or {})
    eff = extra.get("efficiency") or {}
    out["efficiency"]["default"] = {**out["efficiency"]["default"], **(eff.get("default") or {})}
    out["efficiency"]["devices"] = {**(out["efficiency"].get("devices") or {}), **(eff.get("devices") or {})}
    profiles = dict(out["efficiency"].get("profiles") or {})
    for name, vals in (eff.get("profiles") or {}).items():
        profiles[name] = {**(profiles.get(name) or {}), **(vals or {})}
    out["efficiency"]["profiles"] = profiles
    if eff.get("default_profile"):
        out["efficiency"]["default_profile"] = eff["default_profile"]
    return out


class HardwareDB:
    """`profile`: 'end_to_end' (default, data/hardware.yaml efficiency.default_profile) prices a serving
    step; 'kernel' uses the kernel-level factors alone (what kernel microbenchmarks reach)."""

    def __init__(self, extra_file: str | Path | None = None, profile: str | None = None):
        self.raw = _read(None)
        if extra_file:
            self.raw = _merge(self.raw, _read(Path(extra_file)))
        self.profile = profile or self.raw["efficiency"].get("default_profile", "kernel")
        profiles = self.raw["efficiency"].get("profiles") or {}
        if self.profile not in profiles:
            raise ValueError(f"unknown efficiency profile {self.profile!r}; known: {', '.join(sorted(profiles))}")

    def names(self) -> list[str]:
        return sorted(self.raw["devices"]) + sorted(self.raw["systems"])

    def _eff(self, device_key: str) -> Efficiency:
        eff = dict(self.raw["efficiency"]["default"])
        eff.update(self.raw["efficiency"]["profiles"][self.profile] or {})
        eff.update((self.raw["efficiency"].get("devices") or {}).get(device_key) or {})
        return Efficiency(**{k: float(eff[k]) for k in _EFF_KEYS})

    def get(self, name: str) -> Hardware:
        key = name.lower()
        systems, devices = self.raw["systems"], self.raw["devices"]
        sys_entry = {}
        if key in systems:
            sys_entry = dict(systems[key])
            dev_key = sys_entry.pop("device")
        elif key in devices:
            dev_key = key
        else:
            raise ValueError(f"unknown hardware {name!r}; known: {', '.join(self.names())}")
        if dev_key not in devices:
            raise ValueError(f"system {name!r} names unknown device {dev_key!r}")
        dev = {**devices[dev_key], **sys_entry}
        return Hardware(key=key, name=dev.get("name", key), bf16_tflops=float(dev["bf16_tflops"]),
                        int8_tops=float(dev["int8_tops"]),
                        fp8_tflops=float(dev["fp8_tflops"]) if dev.get("fp8_tflops") else None,
                        hbm_gib=float(dev["hbm_gib"]), hbm_tbps=float(dev["hbm_tbps"]),
                        scale_up_gbps=float(dev["scale_up_gbps"]),
                        scale_out_gbps=float(dev["scale_out_gbps"]),
                        scale_up_domain=int(dev.get("scale_up_domain", 8)), eff=self._eff(dev_key))


def load_hardware(name: str, extra_file: str | Path | None = None, profile: str | None = None) -> Hardware:
    return HardwareDB(extra_file, profile).get(name)
